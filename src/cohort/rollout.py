"""The experience half of a GRPO step: prompts -> completions -> rewards -> advantages.

`collect_rollouts` samples G completions per prompt from a `RolloutEngine`, decodes them, scores them with
the reward functions, and turns rewards into advantages. With DAPO's dynamic sampling it drops groups whose
rewards are all equal (they carry no gradient) and samples more prompts until the step is full or the
configured number of tries is spent. The result is a `RolloutBatch` of plain lists and tensors; it knows
nothing of the loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cohort.algorithms import compute_advantages
from cohort.data import PromptBatch
from cohort.types import Completion, RolloutEngine, SamplingParams


@dataclass
class RolloutBatch:
    """N = prompts x G completions, groups contiguous. Lists are per completion."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampling_logprobs: list[list[float]]
    finish_reasons: list[str]
    completions_text: list[str]
    prompts: list[Any]
    rewards_per_func: torch.Tensor  # [N, F], NaN where a function returned None
    rewards: torch.Tensor  # [N] combined
    advantages: torch.Tensor  # [N]
    loss_mask_keep: list[bool]  # False: completion masked out of the loss (e.g. truncated)
    metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.completion_ids)


def decode_completions(tokenizer, completions: Sequence[Completion], conversational: bool) -> list[Any]:
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    if conversational:  # TRL's contract: conversational prompts get message-list completions
        return [[{"role": "assistant", "content": t}] for t in texts]
    return texts


def _repeat(values: Sequence[Any], g: int) -> list[Any]:
    return [v for v in values for _ in range(g)]


def _generate_and_score(engine: RolloutEngine, tokenizer, batch: PromptBatch, params: SamplingParams,
                        reward_runner, trainer_state) -> tuple[list[Completion], list[Any], Any]:
    groups = engine.generate(batch.prompt_ids, params)
    completions = [c for group in groups for c in group]
    conversational = bool(batch.prompts) and isinstance(batch.prompts[0], list)
    texts = decode_completions(tokenizer, completions, conversational)
    g = params.n
    columns = {k: _repeat(v, g) for k, v in batch.columns.items()}
    result = reward_runner(
        prompts=_repeat(batch.prompts, g), completions=texts,
        completion_ids=[c.token_ids for c in completions], columns=columns, trainer_state=trainer_state,
    )
    return completions, texts, result


def collect_rollouts(
    engine: RolloutEngine,
    tokenizer,
    next_prompts: Callable[[int], PromptBatch],
    num_prompts: int,
    params: SamplingParams,
    reward_runner,
    *,
    advantage_kwargs: dict[str, Any],
    trainer_state,
    dynamic_sampling: bool = False,
    max_resample_tries: int = 3,
    max_oversample: int = 4,
    mask_truncated_completions: bool = False,
    gather_rewards: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rank: int = 0,
) -> RolloutBatch:
    """With dynamic_sampling, each try draws the missing prompts divided by the informative-group rate seen
    so far (at most max_oversample times the missing count) and keeps informative groups up to the step size;
    the last try fills the step with all-equal groups if it must.

    gather_rewards / rank (data parallelism): advantages are computed on every rank's rewards together
    (rank order) and this rank keeps its own rows, so batch-level scaling sees the whole step."""
    g = params.n
    if not dynamic_sampling:
        batch = next_prompts(num_prompts)
        completions, texts, result = _generate_and_score(engine, tokenizer, batch, params, reward_runner,
                                                         trainer_state)
        return _assemble([(batch, completions, texts, result)], g, advantage_kwargs, mask_truncated_completions,
                         {"sampling/tries": 1.0}, gather_rewards, rank)
    kept: list[tuple[PromptBatch, list[Completion], list[Any], Any]] = []
    have, tries, zero_std_groups, seen_groups = 0, 0, 0, 0
    while have < num_prompts:
        need = num_prompts - have
        # Over-sample by the informative rate seen so far (as verl's DAPO recipe draws whole generation
        # batches): asking only for the missing prompts converges slowly when most groups are all-equal.
        rate = (seen_groups - zero_std_groups) / seen_groups if seen_groups else 1.0
        draw = min(max_oversample * need, max(need, math.ceil(need / max(rate, 1e-9))))
        batch = next_prompts(draw)
        completions, texts, result = _generate_and_score(engine, tokenizer, batch, params, reward_runner,
                                                         trainer_state)
        zero = compute_advantages(result.rewards, g, **advantage_kwargs).is_std_zero.view(-1, g)[:, 0]
        seen_groups += len(batch.prompt_ids)
        zero_std_groups += int(zero.sum())
        tries += 1
        keep = (~zero).nonzero().flatten().tolist()[:need]
        if tries >= max_resample_tries:  # the last try fills the step, all-equal groups included
            keep = sorted(keep + zero.nonzero().flatten().tolist()[:need - len(keep)])
        batch, completions, texts, result = _select_groups(batch, completions, texts, result, keep, g)
        kept.append((batch, completions, texts, result))
        have += len(batch.prompt_ids)
    # counted over every group sampled, dropped ones included: how much sampling the filter cost
    return _assemble(kept, g, advantage_kwargs, mask_truncated_completions,
                     {"frac_reward_zero_std": zero_std_groups / max(1, seen_groups),
                      "sampling/tries": float(tries), "sampling/groups_drawn": float(seen_groups)},
                     gather_rewards, rank)


def _select_groups(batch: PromptBatch, completions, texts, result, keep: list[int], g: int):
    rows = [i * g + j for i in keep for j in range(g)]
    new_batch = PromptBatch(
        prompts=[batch.prompts[i] for i in keep], prompt_ids=[batch.prompt_ids[i] for i in keep],
        columns={k: [v[i] for i in keep] for k, v in batch.columns.items()},
        indices=[batch.indices[i] for i in keep],
    )
    return new_batch, [completions[r] for r in rows], [texts[r] for r in rows], result.select(rows)


def _assemble(kept, g: int, advantage_kwargs: dict[str, Any], mask_truncated: bool,
              metrics: dict[str, float], gather=None, rank: int = 0) -> RolloutBatch:
    prompt_ids, completions, texts, prompts, results = [], [], [], [], []
    for batch, comps, txts, result in kept:
        prompt_ids += _repeat(batch.prompt_ids, g)
        prompts += _repeat(batch.prompts, g)
        completions += comps
        texts += txts
        results.append(result)
    result = results[0].concat(results) if len(results) > 1 else results[0]
    if gather is None:
        adv = compute_advantages(result.rewards, g, **advantage_kwargs)
    else:
        n = result.rewards.shape[0]
        adv = compute_advantages(gather(result.rewards), g, **advantage_kwargs)
        mine = slice(rank * n, (rank + 1) * n)
        adv = dataclasses.replace(adv, advantages=adv.advantages[mine], rewards=adv.rewards[mine])
    finish = [c.finish_reason for c in completions]
    keep = [not (mask_truncated and f == "length") for f in finish]
    metrics = {"frac_reward_zero_std": adv.frac_reward_zero_std, **metrics, **result.metrics(),
               **_completion_metrics(completions)}
    metrics["reward"] = float(torch.nanmean(adv.rewards))
    metrics["reward_std"] = float(adv.group_std.mean()) if adv.group_std.numel() else 0.0
    return RolloutBatch(
        prompt_ids=prompt_ids, completion_ids=[c.token_ids for c in completions],
        sampling_logprobs=[c.logprobs for c in completions], finish_reasons=finish,
        completions_text=texts, prompts=prompts, rewards_per_func=result.rewards, rewards=adv.rewards,
        advantages=adv.advantages, loss_mask_keep=keep, metrics=metrics,
    )


def _completion_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """TRL's completions/* metrics: length statistics overall and for terminated completions."""
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    stopped = torch.tensor([c.finish_reason == "stop" for c in completions])
    out = {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float((~stopped).float().mean()),
    }
    term = lengths[stopped]
    out["completions/mean_terminated_length"] = float(term.mean()) if term.numel() else 0.0
    out["completions/min_terminated_length"] = float(term.min()) if term.numel() else 0.0
    out["completions/max_terminated_length"] = float(term.max()) if term.numel() else 0.0
    return out
