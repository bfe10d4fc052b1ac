"""Held-out evaluation: mean reward, accuracy and pass@k on prompts never trained on.

Accuracy is read off the first reward function (by convention the correctness reward, e.g. `accuracy` or
`reasoning_gym`): a completion counts as correct when that function gives it at least
`correct_threshold` (1.0 by default, i.e. a fully correct answer). With `run.eval_num_samples = 1` decoding
is greedy (and the accuracy has a 95% Wilson interval over the prompts); with n > 1 it samples n completions
at the training temperature and also reports pass@n (the
share of prompts with at least one correct completion) next to the mean accuracy over all samples, and the
statistics of `cohort.algorithms.eval_stats`: unbiased pass@k for k = 1 and the powers of two below n,
maj@n (majority vote over the answers the first reward function extracts, see `_answers`), mean@n and a 95%
Wilson interval for the accuracy (`accuracy_ci_low`, `accuracy_ci_high`).
Completions are capped at `run.eval_max_completion_length` (default: the training cap).

Seeds: completion j of held-out prompt i is sampled with seed `train.seed + i * n + j`, whatever the batching,
so two evaluations of the same checkpoint draw the same completions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from cohort.algorithms import sampled_eval_metrics, wilson_interval
from cohort.config import CohortConfig
from cohort.rewards.protocol import completion_text
from cohort.rewards.registry import answer_extractor
from cohort.rollout import decode_completions, generate_in_environments
from cohort.types import SamplingParams, TrainerState


@torch.no_grad()
def evaluate(comp, cfg: CohortConfig, *, batch_prompts: int = 64, correct_threshold: float = 1.0,
             samples: list[dict] | None = None, progress: Callable[[str], Any] | None = None) -> dict[str, float]:
    """Greedy accuracy (or mean accuracy, pass@k, maj@n and the accuracy's interval with n samples) and mean
    total reward on comp.eval_data. When `samples` is a list, one row per completion is appended to it:
    prompt, completion, reward, correct. progress: called with a line after each batch of prompts (`cohort
    eval` prints it: an evaluation with many samples per prompt runs for minutes)."""
    k = max(1, cfg.run.eval_num_samples)
    max_tokens = cfg.run.eval_max_completion_length or comp.sampling_params.max_tokens
    params = dataclasses.replace(comp.sampling_params, n=k, seed=cfg.train.seed, max_tokens=max_tokens,
                                 temperature=0.0 if k == 1 else comp.sampling_params.temperature)
    was_training = comp.policy.training
    comp.policy.eval()
    data = comp.eval_data
    correct, rewards, passed, answers = [], [], [], []
    started = time.monotonic()
    for start in range(0, len(data), batch_prompts):
        idx = list(range(start, min(len(data), start + batch_prompts)))
        # prompt i of the eval set draws seeds seed + i * k + j, however the prompts are batched
        seeded = dataclasses.replace(params, seed=params.seed + start * k if params.seed is not None else None)
        prompts, texts, columns, result = _generate_and_score(comp, cfg, data.batch(idx), seeded)
        first = torch.nan_to_num(result.rewards[:, 0], nan=0.0)
        ok = first >= correct_threshold - 1e-6
        correct.append(ok.float())
        rewards.append(torch.nan_to_num(result.total, nan=0.0))
        passed.append(ok.view(-1, k).any(dim=1).float())
        if k > 1:
            answers += _answers(getattr(comp.reward_runner, "funcs", [None])[0], texts, columns)
        if samples is not None:
            samples.extend({"prompt": prompt, "completion": text, "reward": float(total),
                            "correct": bool(good)}
                           for prompt, text, total, good in zip(prompts, texts, result.total.tolist(), ok.tolist()))
        if progress is not None:
            done = idx[-1] + 1
            progress(f"eval: {done}/{len(data)} prompts x {k} ({100 * done / len(data):.0f}%), accuracy so far "
                     f"{float(torch.cat(correct).mean()):.3f}, {time.monotonic() - started:.0f} s")
    if was_training:
        comp.policy.train()
    hits = torch.cat(correct)
    out = {"accuracy": float(hits.mean()), "reward": float(torch.cat(rewards).mean())}
    if k == 1:  # greedy: one trial per prompt (with samples, sampled_eval_metrics gives the interval)
        out["accuracy_ci_low"], out["accuracy_ci_high"] = wilson_interval(int(hits.sum()), hits.numel())
    if k > 1:
        out[f"pass@{k}"] = float(torch.cat(passed).mean())
        outcomes = torch.cat(correct).bool().view(-1, k).tolist()
        grouped = [answers[i:i + k] for i in range(0, len(answers), k)]
        out.update({name: value for name, value in sampled_eval_metrics(outcomes, grouped).items() if name not in out})
    return out


def _generate_and_score(comp, cfg: CohortConfig, batch, params: SamplingParams) -> tuple[list, list, dict, Any]:
    """One batch of held-out prompts: n completions each (with the run's tools or environments), scored.
    Returns the per-completion prompts, texts and columns, and the `RewardResult`."""
    k = params.n
    turn_loop = getattr(comp, "turn_loop", None)  # with tools (or environments), evaluated with them
    rep = [i for i in range(len(batch.prompts)) for _ in range(k)]
    prompts = [batch.prompts[i] for i in rep]
    columns = {name: [col[i] for i in rep] for name, col in batch.columns.items()}
    if turn_loop is None:
        groups = comp.engine.generate(batch.prompt_ids, params)
    elif getattr(turn_loop, "environments", None) is not None:  # one reset instance per rollout
        env = generate_in_environments(turn_loop, comp.engine, comp.tokenizer, batch, params)
        groups, prompts, columns["environments"] = env.groups, env.prompts, env.instances
    else:
        groups = turn_loop.generate(comp.engine, batch.prompt_ids, params, prompts=batch.prompts)
    completions = [c for group in groups for c in group]
    conversational = bool(batch.prompts) and isinstance(batch.prompts[0], list)
    texts = decode_completions(comp.tokenizer, completions, conversational)
    result = comp.reward_runner(
        prompts=prompts, completions=texts,
        completion_ids=[c.token_ids for c in completions],
        columns=columns,
        trainer_state=TrainerState(global_step=-1, max_steps=cfg.train.max_steps, is_eval=True))
    return prompts, texts, columns, result


def _answers(first_reward, texts: list, columns: dict[str, list]) -> list[str]:
    """The answer each completion votes for in maj@n: what the first reward function extracts from its text
    (`cohort.rewards.registry.answer_extractor`: accuracy's `<answer>`/`\\boxed{}`, answer_number's number,
    reasoning_gym's own rule, or a function's `extract_answer`); the stripped completion text where it has no
    such rule or finds nothing."""
    extract = answer_extractor(first_reward)
    out = []
    for j, completion in enumerate(texts):
        text = completion_text(completion)
        answer = None
        if extract is not None:
            answer = extract(text, {name: values[j] for name, values in columns.items()})
        out.append(text.strip() if answer is None else str(answer).strip())
    return out
