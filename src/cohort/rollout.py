"""The experience half of a GRPO step: prompts -> completions -> rewards -> advantages.

`collect_rollouts` samples G completions per prompt from a `RolloutEngine`, decodes them, scores them with
the reward functions, and turns rewards into advantages. With DAPO's dynamic sampling it drops groups whose
rewards are all equal (they carry no gradient) and samples more prompts until the step is full or the
configured number of tries is spent (with several ranks too: `collect_rollouts` says how they agree).
The result is a `RolloutBatch` of plain lists and tensors; it knows nothing of the loss.

With a `turn_loop` (tool calling, `cohort.agents.rollout_loop.TurnLoop`), completions are multi-turn: each
holds the model's turns and the tool results between them, and `completion_masks` says which tokens are the
model's (the only ones the loss trains on).

Estimators that need more than the rewards get it here: each completion's trained token count (opo,
reinforce_plus_plus), and for remax one extra greedy completion per prompt (temperature 0, n = 1), scored by
the same reward functions and never trained on (`cohort.algorithms.estimator_base`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cohort.agents.environments import append_observation
from cohort.algorithms import (
    DEFAULT_ESTIMATOR,
    AdvantageEstimator,
    build_advantage_estimator,
    compute_advantages,
)
from cohort.data import PromptBatch
from cohort.data.dataset import _tokenize_prompt
from cohort.data.detokenize import batch_decode
from cohort.types import Completion, RolloutBatch, RolloutEngine, SamplingParams


def decode_completions(tokenizer, completions: Sequence[Completion], conversational: bool) -> list[Any]:
    texts = batch_decode(tokenizer, [c.token_ids for c in completions])  # batch_decode's text, in one Rust call
    if conversational:  # TRL's contract: conversational prompts get message-list completions
        # multi-turn (tools): the turns and tool results as messages, so rewards read the final answer
        return [c.messages if c.messages is not None else [{"role": "assistant", "content": t}]
                for c, t in zip(completions, texts)]
    return texts


def _repeat(values: Sequence[Any], g: int) -> list[Any]:
    return [v for v in values for _ in range(g)]


@dataclass
class EnvironmentRollouts:
    """`generate_in_environments`' result: the groups, and per rollout its prompt (reset's text appended), its
    prompt ids and its environment instance."""

    groups: list[list[Completion]]
    prompts: list[Any]
    prompt_ids: list[list[int]]
    instances: list[Any]


def generate_in_environments(turn_loop, engine: RolloutEngine, tokenizer, batch: PromptBatch,
                             params: SamplingParams) -> EnvironmentRollouts:
    """environment_factory (TRL 1.16): every rollout (each of the G completions of a prompt) gets its own
    environment instance, reset with its row (`prompt` and every column); the text reset returns is appended to
    the prompt's last message, and the instance's methods are that rollout's tools.

    A group whose G resets returned the same text (or None) keeps one prompt encoding and is generated as a
    group (the engine prefills the shared prompt once); a group whose resets differ is encoded per rollout and
    generated as G prompts of one completion each."""
    envs, g = turn_loop.environments, params.n
    n_prompts = len(_encoded(batch))
    rows = [{"prompt": batch.prompts[i], **{k: v[i] for k, v in batch.columns.items()}}
            for i in range(n_prompts) for _ in range(g)]
    sessions = envs.start(rows)
    prompts = [append_observation(batch.prompts[r // g], s.observation) for r, s in enumerate(sessions)]
    runners = [s.runner(timeout_s=turn_loop.tool_timeout_s) for s in sessions]

    def encode(r: int) -> list[int]:
        s = sessions[r]
        if s.observation is None and not envs.multi:  # the data's encoding (rendered with the same tools)
            return list(_encoded(batch)[r // g])
        kwargs = {**turn_loop.template_kwargs, "tools": [t.schema for t in s.tools]}
        return _tokenize_prompt(tokenizer, prompts[r], "environment_factory", r, kwargs)

    uniform = [i for i in range(n_prompts)
               if all(sessions[i * g + j].observation == sessions[i * g].observation for j in range(g))]
    varied = [i for i in range(n_prompts) if i not in set(uniform)]
    groups: list[Any] = [None] * n_prompts
    prompt_ids: list[Any] = [None] * (n_prompts * g)
    if uniform:
        ids = [encode(i * g) for i in uniform]
        out = turn_loop.generate(engine, ids, params, prompts=[prompts[i * g] for i in uniform],
                                 runners=[runners[i * g + j] for i in uniform for j in range(g)])
        for i, group, pid in zip(uniform, out, ids):
            groups[i] = group
            prompt_ids[i * g:(i + 1) * g] = [pid] * g
    if varied:
        rollouts = [i * g + j for i in varied for j in range(g)]
        ids = [encode(r) for r in rollouts]
        out = turn_loop.generate(engine, ids, dataclasses.replace(params, n=1), prompts=[prompts[r] for r in rollouts],
                                 runners=[runners[r] for r in rollouts])
        for k, i in enumerate(varied):
            groups[i] = [out[k * g + j][0] for j in range(g)]
            prompt_ids[i * g:(i + 1) * g] = ids[k * g:(k + 1) * g]
    return EnvironmentRollouts(groups, prompts, prompt_ids, [s.instance for s in sessions])


def _generate_and_score(engine: RolloutEngine, tokenizer, batch: PromptBatch, *, params: SamplingParams,
                        reward_runner, trainer_state, turn_loop=None,
                        greedy_baseline: bool = False) -> tuple[list[Completion], list[Any], Any, Any, Any]:
    """Also returns the per-rollout (prompts, prompt_ids) with environments (reset may change each rollout's
    prompt), else None (the batch's prompts, G times each), and with `greedy_baseline` the `RewardResult` of
    one greedy completion per prompt (remax's baseline, else None)."""
    g = params.n
    columns = {k: _repeat(v, g) for k, v in batch.columns.items()}
    prompts, per_rollout = _repeat(batch.prompts, g), None
    if turn_loop is None:
        groups = engine.generate(_encoded(batch), params)
    elif getattr(turn_loop, "environments", None) is not None:
        env = generate_in_environments(turn_loop, engine, tokenizer, batch, params)
        groups, prompts, per_rollout = env.groups, env.prompts, (env.prompts, env.prompt_ids)
        columns["environments"] = env.instances  # TRL's kwarg: the environments' get_reward functions read it
    else:
        groups = turn_loop.generate(engine, batch.prompt_ids, params, prompts=batch.prompts)
    completions = [c for group in groups for c in group]
    conversational = bool(batch.prompts) and isinstance(batch.prompts[0], list)
    texts = decode_completions(tokenizer, completions, conversational)
    result = reward_runner(
        prompts=prompts, completions=texts,
        completion_ids=[c.token_ids for c in completions], columns=columns, trainer_state=trainer_state,
    )
    greedy = None
    if greedy_baseline:  # the same prompts, reward functions and turn loop; one greedy completion each
        greedy = _generate_and_score(engine, tokenizer, batch, params=dataclasses.replace(params, n=1, temperature=0.0),
                                     reward_runner=reward_runner, trainer_state=trainer_state, turn_loop=turn_loop)[2]
    return completions, texts, result, per_rollout, greedy


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
    turn_loop=None,
) -> RolloutBatch:
    """With dynamic_sampling, each try draws the missing prompts divided by the informative-group rate seen
    so far (at most max_oversample times the missing count) and keeps informative groups up to the step size;
    the last try fills the step with all-equal groups if it must.

    turn_loop: multi-turn tool calling (`cohort.agents.rollout_loop.TurnLoop`); None samples single turns.

    gather_rewards / rank (data parallelism): `gather_rewards` concatenates a tensor's rows over the ranks in
    rank order (`distributed.all_gather_rows`). Advantages are computed on every rank's rewards together and
    this rank keeps its own rows, so batch-level scaling sees the whole step.

    Dynamic sampling with several ranks: each rank filters and refills its own slice of the step
    (num_prompts groups each), and the ranks agree on every try, so all of them make the same collective
    calls. On each try every rank says how many prompts it wants (0 once it holds its share) and all draw
    the largest count from the shared seeded sampler, which therefore advances identically everywhere; a
    rank generates only the part of its slice it asked for. The ranks keep trying while any rank is short;
    the tries are counted the same everywhere, so the last try fills every short rank with all-equal groups.
    Every rank ends with exactly num_prompts groups, `sampling/tries` is the same on every rank, and
    `frac_reward_zero_std` and `sampling/groups_drawn` count the groups of all ranks. A single controller
    (verl's DAPO recipe) filters the whole step's groups as one pool instead and keeps the first
    prompts_per_step informative ones (TRL's GRPOTrainer has no dynamic sampling): the steps hold the same
    number of informative groups whenever every rank fills its share, but here one rank's surplus cannot
    fill another rank's gap, so a rank may need another try, or take all-equal groups on the last try,
    where a pooled filter would not have. With one rank this is exactly the single-process loop."""
    g = params.n
    greedy = _estimator(advantage_kwargs).needs_greedy_baseline
    score = functools.partial(_generate_and_score, engine, tokenizer, params=params, reward_runner=reward_runner,
                              trainer_state=trainer_state, turn_loop=turn_loop, greedy_baseline=greedy)
    if not dynamic_sampling:
        batch = next_prompts(num_prompts)
        kept, metrics = [(batch, *score(batch))], {"sampling/tries": 1.0}
    else:
        kept, metrics = _dynamic_sampling(score, next_prompts, num_prompts, g, advantage_kwargs, max_resample_tries,
                                          max_oversample, gather_rewards)
    return _assemble(kept, g, advantage_kwargs, mask_truncated_completions, metrics, gather_rewards, rank)


def _dynamic_sampling(score, next_prompts: Callable[[int], PromptBatch], num_prompts: int, g: int,
                      advantage_kwargs: dict[str, Any], max_resample_tries: int, max_oversample: int,
                      gather_rewards) -> tuple[list[tuple], dict[str, float]]:
    """DAPO's filter (see collect_rollouts): the kept groups of every try, and the sampling metrics."""
    kept: list[tuple[PromptBatch, list[Completion], list[Any], Any, Any, Any]] = []
    have, tries, zero_std_groups, seen_groups = 0, 0, 0, 0
    while True:
        need = num_prompts - have
        # Over-sample by the informative rate seen so far (as verl's DAPO recipe draws whole generation
        # batches): asking only for the missing prompts converges slowly when most groups are all-equal.
        rate = (seen_groups - zero_std_groups) / seen_groups if seen_groups else 1.0
        want = min(max_oversample * need, max(need, math.ceil(need / max(rate, 1e-9)))) if need else 0
        # several ranks: all draw the largest count any rank wants, and stop together when none wants more
        draw = want if gather_rewards is None else int(gather_rewards(torch.tensor([want])).max())
        if draw == 0:
            break
        batch = next_prompts(draw)
        tries += 1
        if want == 0:  # this rank holds its share; it only keeps the sampler in step with the others
            continue
        if want < draw:
            batch = _first_prompts(batch, want)
        completions, texts, result, per_rollout, greedy = score(batch)
        zero = compute_advantages(result.rewards, g, **advantage_kwargs,
                                  **_estimator_inputs(completions, greedy)).is_std_zero.view(-1, g)[:, 0]
        seen_groups += len(_encoded(batch))
        zero_std_groups += int(zero.sum())
        keep = (~zero).nonzero().flatten().tolist()[:need]
        if tries >= max_resample_tries:  # the last try fills the step, all-equal groups included
            keep = sorted(keep + zero.nonzero().flatten().tolist()[:need - len(keep)])
        kept.append(_select_groups(batch, completions, texts, result, per_rollout, greedy, keep, g))
        have += len(_encoded(kept[-1][0]))
    if gather_rewards is not None:  # the counts of every rank, so the metrics describe the whole step
        counts = gather_rewards(torch.tensor([zero_std_groups, seen_groups])).view(-1, 2).sum(dim=0)
        zero_std_groups, seen_groups = int(counts[0]), int(counts[1])
    # counted over every group sampled, dropped ones included: how much sampling the filter cost
    return kept, {"frac_reward_zero_std": zero_std_groups / max(1, seen_groups),
                  "sampling/tries": float(tries), "sampling/groups_drawn": float(seen_groups)}


def _encoded(batch: PromptBatch) -> list[list[int]]:
    """The batch's prompt token ids: rollouts need an encoded dataset (PromptDataset.encode)."""
    if batch.prompt_ids is None:
        raise ValueError("rollouts need tokenized prompts: encode the dataset first (PromptDataset.encode)")
    return batch.prompt_ids


def _first_prompts(batch: PromptBatch, count: int) -> PromptBatch:
    return PromptBatch(prompts=batch.prompts[:count], prompt_ids=_encoded(batch)[:count],
                       columns={k: v[:count] for k, v in batch.columns.items()}, indices=batch.indices[:count])


def _select_groups(batch: PromptBatch, completions, texts, result, per_rollout, greedy, keep: list[int], g: int):
    rows = [i * g + j for i in keep for j in range(g)]
    new_batch = PromptBatch(
        prompts=[batch.prompts[i] for i in keep], prompt_ids=[_encoded(batch)[i] for i in keep],
        columns={k: [v[i] for i in keep] for k, v in batch.columns.items()},
        indices=[batch.indices[i] for i in keep],
    )
    if per_rollout is not None:
        per_rollout = tuple([column[r] for r in rows] for column in per_rollout)
    return (new_batch, [completions[r] for r in rows], [texts[r] for r in rows], result.select(rows), per_rollout,
            None if greedy is None else greedy.select(keep))


def _estimator(advantage_kwargs: dict[str, Any]) -> AdvantageEstimator:
    return build_advantage_estimator(advantage_kwargs.get("estimator", DEFAULT_ESTIMATOR))


def _estimator_inputs(completions: Sequence[Completion], greedy) -> dict[str, Any]:
    """compute_advantages' inputs beyond the rewards: each completion's trained tokens (the model's, not tool
    results) and, with remax, the greedy completions' [P, F] rewards (the estimator uses what it declares)."""
    lengths = torch.tensor([sum(c.mask) if c.mask is not None else len(c.token_ids) for c in completions],
                           dtype=torch.float32)
    return {"lengths": lengths, "baseline_rewards": None if greedy is None else greedy.rewards}


def _assemble(kept, g: int, advantage_kwargs: dict[str, Any], mask_truncated: bool,
              metrics: dict[str, float], gather=None, rank: int = 0) -> RolloutBatch:
    prompt_ids, completions, texts, prompts, results, greedy = [], [], [], [], [], []
    for batch, comps, txts, result, per_rollout, baseline in kept:
        if per_rollout is None:
            prompt_ids += _repeat(batch.prompt_ids, g)
            prompts += _repeat(batch.prompts, g)
        else:  # environments: each rollout's own prompt (reset's text appended) and its encoding
            prompts += per_rollout[0]
            prompt_ids += per_rollout[1]
        completions += comps
        texts += txts
        results.append(result)
        greedy += [] if baseline is None else [baseline]
    # a completion whose context holds model inputs (a tool's images): its prompt carries them to the update
    prompt_ids = [p if c.context_inputs is None else c.context_inputs.training_prompt(p)
                  for p, c in zip(prompt_ids, completions, strict=True)]
    result = results[0].concat(results) if len(results) > 1 else results[0]
    baselines = greedy[0].concat(greedy) if greedy else None
    extras = _estimator_inputs(completions, baselines)
    if gather is None:
        all_rewards = result.rewards
        adv = compute_advantages(all_rewards, g, **advantage_kwargs, **extras)
    else:  # the lengths and greedy rewards of every rank too, in the same rank order as the rewards
        n = result.rewards.shape[0]
        extras = {k: None if v is None else gather(v) for k, v in extras.items()}
        all_rewards = gather(result.rewards)
        adv = compute_advantages(all_rewards, g, **advantage_kwargs, **extras)
        mine = slice(rank * n, (rank + 1) * n)
        adv = dataclasses.replace(adv, advantages=adv.advantages[mine], rewards=adv.rewards[mine])
    finish = [c.finish_reason for c in completions]
    keep = [not (mask_truncated and f == "length") for f in finish]
    metrics = {"frac_reward_zero_std": adv.frac_reward_zero_std, **metrics, **result.metrics(),
               **_completion_metrics(completions)}
    # TRL 1.16's reward and reward_std: the mean and std over the whole step (every rank) of the raw weighted sum
    # of the functions' rewards, whatever the aggregation (normalize_then_sum's combination is normalised);
    # cohort's mean of per-group stds keeps its own name
    weighted = _weighted_sum(all_rewards, result.weights)
    metrics["reward"] = float(torch.nanmean(weighted))
    metrics["reward_std"] = float(_nanstd(weighted))
    metrics["reward_std_group_mean"] = float(adv.group_std.mean()) if adv.group_std.numel() else 0.0
    if baselines is not None:  # remax: the greedy completions' mean combined reward (this rank's prompts)
        metrics["remax/greedy_reward"] = float(torch.nanmean(baselines.total))
    return RolloutBatch(
        prompt_ids=prompt_ids, completion_ids=[c.token_ids for c in completions],
        sampling_logprobs=[c.logprobs for c in completions], finish_reasons=finish,
        completions_text=texts, prompts=prompts, rewards_per_func=result.rewards, rewards=adv.rewards,
        advantages=adv.advantages, loss_mask_keep=keep, group_size=g, metrics=metrics,
        completion_masks=[c.mask for c in completions] if any(c.mask is not None for c in completions) else None,
        extra_columns={k: v for k, v in getattr(result, "extra", {}).items() if len(v) == len(completions)},
        policy_versions=[c.version for c in completions] if any(c.version is not None for c in completions) else None,
        routed_experts=([c.routed_experts for c in completions]
                        if any(c.routed_experts is not None for c in completions) else None),
        token_versions=([c.token_versions for c in completions]
                        if any(c.token_versions is not None for c in completions) else None),
    )


def _weighted_sum(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N, F] raw rewards -> [N] weighted nansum, NaN where every function is NaN (unscorable rows, left out of the
    logged reward as TRL leaves them out)."""
    per_func = rewards.unsqueeze(1) if rewards.dim() == 1 else rewards
    total = (per_func * weights.to(per_func.device, per_func.dtype).unsqueeze(0)).nansum(dim=1)
    total[torch.isnan(per_func).all(dim=1)] = torch.nan
    return total


def _nanstd(x: torch.Tensor) -> torch.Tensor:
    """TRL's nanstd: the unbiased std over the non-NaN entries."""
    kept = x[~torch.isnan(x)]
    return kept.std() if kept.numel() > 1 else torch.tensor(0.0)


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
    if any(c.tool_calls is not None for c in completions):
        # TRL's tools/* metrics: calls per completion, and the share of calls that failed
        calls = sum(c.tool_calls or 0 for c in completions)
        out["tools/call_frequency"] = calls / len(completions)
        out["tools/failure_frequency"] = sum(c.tool_failures for c in completions) / calls if calls else 0.0
        out["tools/turns_per_completion"] = sum(c.turns for c in completions) / len(completions)
    return out
