"""The learning half of a GRPO step: rollouts -> policy update.

`PolicyUpdater.update` takes a `RolloutBatch`, splits it into `mini_batches` optimiser updates of whole
groups, and passes over them `num_iterations` times. Each mini-batch is cut into micro-batches by a token
budget (packed, padding-free forward), and every micro-batch's loss is normalised by the mini-batch's
*global* token and sequence counts, so gradient accumulation gives exactly the whole-batch gradient for
every loss type. The updater never looks at the loss type: the loss object owns its maths.

The loss mask is per token (`RolloutBatch.token_mask`): padding, completions masked out (truncated ones with
mask_truncated_completions) and the tool-result tokens of multi-turn completions are 0, so they are never
trained on and never counted in `num_tokens` or in any metric. Their logprobs are still computed (the packed
forward runs over whole sequences) and multiplied by 0.

A mixture-of-experts policy with `router_aux_loss_coef` > 0 also trains on the router load-balancing loss of each
micro-batch's packed row (as TRL adds `outputs.aux_loss` of each micro-batch), weighted by the row's share of the
mini-batch's tokens, and logs it as `aux_loss` (the token-weighted mean of the micro-batches' values). With
`router_replay` the policy's forwards route each token to the experts the engine recorded (cohort.forward.router_replay).

Old logprobs are computed only when the update is off-policy (several mini-batches or iterations); on
policy, the loss uses the current logprobs detached, exactly as TRL does. With generation.logprob_parity=exact
they are the engine's sampling logprobs, which equal the recompute bit for bit (cohort.forward.invariant.parity).

With `context_parallel` > 1 the update trains its context-parallel group's rollouts, each packed row split over
the group's ranks (cohort.distributed.context_parallel); counts and metrics are counted once per group.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cohort import distributed
from cohort.algorithms import LossInputs, reduce_metrics
from cohort.distributed.context_parallel import ContextGroup
from cohort.distributed.fsdp import clip_grad_norm
from cohort.errors import CohortError
from cohort.forward.invariant.parity import sampled_old_logprobs
from cohort.forward.micro_batches import (
    split_grouped_micro_batches,
    split_micro_batches,
    spread_micro_batches,
)
from cohort.forward.packing import PackedRow, host_to_device, pack_row, packed_forward_logprobs
from cohort.forward.plugins import has_extra_inputs
from cohort.forward.recurrent import one_sequence_per_row
from cohort.forward.router_replay import RouterReplayer
from cohort.forward.shared_prompts import prompt_groups
from cohort.run.callbacks import UpdateEvent
from cohort.types import RolloutBatch


@dataclass
class UpdateSettings:
    mini_batches: int
    num_iterations: int
    token_budget: int
    temperature: float
    max_grad_norm: float
    max_completion_length: int
    chunk_tokens: int = 4096  # logprob kernel chunk (train.logprob_chunk_tokens)
    lm_head_grad_fp32: bool = True  # False with train.master_weights=false: the low-memory setting
    keep_logits: bool = False  # train.keep_logits: the logprob kernel keeps its logits for the backward
    sharded: bool = False  # FSDP: gradients are reduced by FSDP, every rank runs the same number of passes
    reduce_every_micro_batch: bool = True  # FSDP: reduce-scatter after each micro-batch, or after the last only
    max_nonfinite_updates: int = 3  # train.max_nonfinite_updates: skipped updates in a row before the run stops
    share_prompts: bool = False  # train.share_prompts: one copy of a group's prompt per row (cohort.forward.shared_prompts)
    # loss.router_aux_loss_coef resolved against the policy's config at set-up (None: the model's own coefficient);
    # 0.0: no router load-balancing loss (dense models, or turned off)
    router_aux_loss_coef: float = 0.0
    # train.context_parallel: ranks per group that split each packed row (cohort.distributed.context_parallel)
    context_parallel: int = 1
    # train.router_replay: the policy's forwards route each token to the experts the engine recorded for it
    router_replay: bool = False
    logprob_parity: str = "fast"  # generation.logprob_parity: "exact" takes the old logprobs from the engine


class NonFiniteUpdateError(CohortError):
    """train.max_nonfinite_updates optimiser updates in a row had a non-finite loss or gradient norm."""


def fused_adam_of(optimizer) -> torch.optim.Optimizer | None:
    """The fused torch Adam/AdamW that runs `optimizer`'s update (itself, or MasterWeightAdamW's inner one), or
    None. A fused Adam skips its update on the device when `found_inf` is set (the AMP GradScaler contract),
    which lets the update decide a non-finite skip without a host-device synchronisation."""
    inner = getattr(optimizer, "inner", optimizer)
    if isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and inner.defaults.get("fused"):
        return inner
    return None


def pad_rows(rows: Sequence[torch.Tensor], width: int, value: float = 0.0) -> torch.Tensor:
    out = rows[0].new_full((len(rows), width), value)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def _members(rows: list[int], micro_batches: list[list[int]]) -> list[list[int]]:
    """Each micro-batch's rows of the batch; an empty micro-batch runs over the first row (its result unused)."""
    return [[rows[i] for i in micro] or rows[:1] for micro in micro_batches]


def _pairs(batch: RolloutBatch, idx: list[int]) -> list[tuple]:
    """The (prompt ids, completion ids) of rows `idx`: what a packed row is built from."""
    return [(batch.prompt_ids[r], batch.completion_ids[r]) for r in idx]


class PolicyUpdater:
    def __init__(self, policy, optimizer, scheduler, loss_fn, settings: UpdateSettings, *, reference=None,
                 device: torch.device | str = "cpu", grad_reducer=None, on_update=None):
        self.policy, self.optimizer, self.scheduler = policy, optimizer, scheduler
        self.loss_fn, self.s, self.reference, self.device = loss_fn, settings, reference, torch.device(device)
        # data parallel without sharding: sums gradients over ranks while the last backward runs
        self.grad_reducer = grad_reducer
        self.params = [p for p in policy.parameters() if p.requires_grad]
        # optimiser updates skipped in a row for a non-finite loss or gradient norm (kept in checkpoints)
        self.nonfinite_streak = 0
        self.step = 0  # the training step being updated, for the error message
        # context parallelism: the group that trains its ranks' rollouts together, each row split over it
        self.context = ContextGroup(settings.context_parallel) if settings.context_parallel > 1 else None
        self.replayer = RouterReplayer(policy) if settings.router_replay else None  # cohort.forward.router_replay
        # on_update(event): each moment of each optimiser update (cohort.run.callbacks.UpdateEvent); the
        # trainer's callbacks ride on it (the TRL facade's on_step_begin / on_pre_optimizer_step / ... callbacks)
        self.on_update: Callable[[UpdateEvent], Any] = on_update or (lambda event: None)

    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        """Token-budget micro-batches of `rows` (indices into it); sharded, every rank runs as many as the rank
        that needs the most (each forward gathers parameters collectively), an empty one being a zero-weight
        pass. With share_prompts, a prompt's completions stay together so their row holds it once (prompts
        with images keep the plain layout: their token ids alone do not say that the images match)."""
        prompts = [batch.prompt_ids[r] for r in rows]
        prompt_lens = [len(p) for p in prompts]
        completion_lens = [len(batch.completion_ids[r]) for r in rows]
        lengths = [p + c for p, c in zip(prompt_lens, completion_lens, strict=True)]
        # (the trainer's schedule line says that prompts with images are not shared)
        if one_sequence_per_row(self.policy):  # a recurrent state would leak across a packed row's sequences
            micro = [[i] for i in range(len(rows))]
        elif self.s.share_prompts and not has_extra_inputs(prompts):
            micro = split_grouped_micro_batches(prompt_groups(prompts), prompt_lens, completion_lens,
                                                self.s.token_budget)
        else:
            micro = split_micro_batches(lengths, self.s.token_budget)
        if not self.s.sharded:
            return micro
        return spread_micro_batches(micro, lengths, distributed.all_max(len(micro)))

    # -- logprobs of fixed models (no grad) ------------------------------------------------------------
    @torch.no_grad()
    def _logprobs_of(self, model, batch: RolloutBatch, rows: list[int]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        micro_batches = self._micro_batches(batch, rows)
        members = _members(rows, micro_batches)  # an empty micro-batch: a pass whose result is dropped
        row = self._row(model, batch, members, 0)
        for m, (micro, idx) in enumerate(zip(micro_batches, members, strict=True)):
            self._use_replay(model, row)
            packed = packed_forward_logprobs(
                model, _pairs(batch, idx), temperature=self.s.temperature, compute_entropy=False,
                chunk_tokens=self.s.chunk_tokens, share_prompts=self.s.share_prompts, row=row)
            row = self._row(model, batch, members, m + 1)  # while the GPU runs this forward
            if micro:
                out.update({r: lp.float() for r, (lp, _) in zip(idx, packed.split())})
        return out

    # -- one optimiser update ------------------------------------------------------------------------------
    def _mini_batch_step(self, batch: RolloutBatch, rows: list[int], old: dict | None, ref: dict | None,
                         sums: dict[str, float]) -> None:
        """One optimiser update over `rows`; adds its reduced metrics into `sums`.

        Counts, masks and engine logprobs are built on the host from the rollout's lists and sent in one copy
        per micro-batch: nothing in the micro-batch loop waits for the GPU. A micro-batch's masks and the next
        micro-batch's packed row are built while the GPU runs its forward.
        """
        self.on_update(UpdateEvent.BEGIN)
        self.policy.train()
        with self._replay_scope():
            parts, finite = self._accumulate(batch, rows, old, ref)
        norm, skip = self._optimizer_step(self._reduce_and_clip(), finite)
        # the metrics are read after the optimizer's kernels are queued (reading them is a host-device sync)
        local = reduce_metrics(parts)  # partial sums of this rank -> summed over ranks (min/max by min/max)
        if self.context is not None:  # every rank of a context-parallel group computed the same loss
            local = self.context.once_metrics(local)
        for k, v in distributed.reduce_metrics(local, summed=tuple(local)).items():
            sums[k] += float(v)
        sums["grad_norm"] += norm
        if skip:
            sums["skipped_updates"] += 1
            self.nonfinite_streak += 1
        else:
            self.nonfinite_streak = 0
        if self.nonfinite_streak >= self.s.max_nonfinite_updates:
            raise NonFiniteUpdateError(
                f"step {self.step}: the loss or gradient norm was non-finite (NaN or inf) in "
                f"{self.nonfinite_streak} optimiser updates in a row (train.max_nonfinite_updates="
                f"{self.s.max_nonfinite_updates}); each was skipped, so the weights and optimizer state are those "
                "of the last finite update. Look for NaN rewards or advantages, lower train.learning_rate, keep "
                "train.max_grad_norm set, or raise train.max_nonfinite_updates; --resume continues from the last "
                "checkpoint")

    def _accumulate(self, batch: RolloutBatch, rows: list[int], old: dict | None,
                    ref: dict | None) -> tuple[list[dict], torch.Tensor]:
        """Forward and backward of every micro-batch of `rows`; their metrics, and whether every loss was finite
        (a device flag, read once after the last backward)."""
        # normalisers of the whole mini-batch, summed over data-parallel ranks
        num_tokens = distributed.all_sum(self._once(sum(batch.loss_token_count(r) for r in rows)))
        num_sequences = int(distributed.all_sum(self._once(len(rows))))
        parts: list[dict] = []
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        micro_batches = self._micro_batches(batch, rows)
        members = _members(rows, micro_batches)  # an empty micro-batch (sharded padding): a zero-weight pass
        aux_weights = self._aux_weights(batch, micro_batches)
        row = self._row(self.policy, batch, members, 0)
        for m, (micro, idx) in enumerate(zip(micro_batches, members, strict=True)):
            self._use_replay(self.policy, row)  # this row's recorded routing, through its backward
            packed = packed_forward_logprobs(
                self.policy, _pairs(batch, idx), temperature=self.s.temperature, compute_entropy=True,
                chunk_tokens=self.s.chunk_tokens, lm_head_grad_fp32=self.s.lm_head_grad_fp32,
                keep_logits=self.s.keep_logits, share_prompts=self.s.share_prompts, row=row,
                router_aux_loss=aux_weights is not None)
            # Host work while the GPU runs this forward (its kernels are queued): this micro-batch's loss inputs
            # and the next one's packed row. Built before the forward, they left the GPU idle (~9 ms a
            # micro-batch for the 0.5B bench update on an H100 host).
            width = max(len(batch.completion_ids[r]) for r in idx)
            mask, sampling, advantages = self._host_tensors(batch, idx, width)
            row = self._row(self.policy, batch, members, m + 1)
            out = self.loss_fn(LossInputs(
                logprobs=packed.padded("logprobs"),
                old_logprobs=None if old is None else pad_rows([old[r] for r in idx], width),
                advantages=advantages, mask=mask,
                ref_logprobs=None if ref is None else pad_rows([ref[r] for r in idx], width),
                sampling_logprobs=sampling,
                entropy=packed.padded("entropy"),  # with grad: the entropy bonus (entropy_coef) needs it
                num_tokens=max(num_tokens, 1), num_sequences=num_sequences,
                max_completion_length=self.s.max_completion_length,
            ))
            last = m == len(micro_batches) - 1
            if self.grad_reducer is not None and last:
                self.grad_reducer.arm()  # the last backward of this update: reduce buckets as they are ready
            if self.s.sharded and not self.s.reduce_every_micro_batch:
                self.policy.set_requires_gradient_sync(last)  # sum unsharded until the last micro-batch
            loss, metrics = self._with_aux_loss(out.loss, out.metrics, packed.aux_loss,
                                                None if aux_weights is None else aux_weights[m])
            (loss if micro else loss * 0.0).backward()
            if micro:
                parts.append(metrics)
                finite &= torch.isfinite(loss.detach()).to(finite.device)
        return parts, finite

    def _once(self, count: float) -> float:
        """A count of this rank's rows for a world sum: a context-parallel group's shared rows count once."""
        return count if self.context is None else self.context.once(count)

    def _aux_weights(self, batch: RolloutBatch, micro_batches: list[list[int]]) -> list[float] | None:
        """Each micro-batch's share of the mini-batch's tokens (prompt and completion, summed over data-parallel
        ranks): the weight of its router load-balancing loss, so that the micro-batches' terms add up to the
        token-weighted mean over the mini-batch. None when the router loss is off."""
        if self.s.router_aux_loss_coef <= 0:
            return None
        tokens = [sum(len(batch.prompt_ids[r]) + len(batch.completion_ids[r]) for r in micro)
                  for micro in micro_batches]
        total = max(float(distributed.all_sum(sum(tokens))), 1.0)
        return [n / total for n in tokens]

    def _with_aux_loss(self, loss: torch.Tensor, metrics: dict, aux: torch.Tensor | None,
                       weight: float | None) -> tuple[torch.Tensor, dict]:
        """The micro-batch's loss plus coef * weight * its router load-balancing loss, and `aux_loss` among its
        metrics (a partial value, summed over micro-batches and ranks as the loss's metrics are)."""
        if aux is None or weight is None:  # off, or a plug-in forward (prompts with images) that returned none
            return loss, metrics
        aux = aux.to(loss.device).float()
        return loss + self.s.router_aux_loss_coef * weight * aux, {**metrics, "aux_loss": weight * aux.detach()}

    def _optimizer_step(self, grad_norm: torch.Tensor | float, finite: torch.Tensor) -> tuple[float, bool]:
        """The optimizer step, skipped on every rank when any rank's loss or gradient norm is not finite; the
        norm and whether it was skipped."""
        # FSDP keeps the device-side skip out: its DTensor parameters would meet a plain found_inf tensor
        fused = None if self.s.sharded else fused_adam_of(self.optimizer)
        if fused is not None:
            # The skip decision stays on the device: the fused AdamW kernel reads it (found_inf) and leaves
            # weights, moments and step count as they are when it is set. The host reads the norm and the flag
            # once the optimizer's kernels are queued, so the GPU never idles while the host launches them.
            norm_t = torch.as_tensor(grad_norm, device=finite.device).detach().float().reshape(())
            bad = ~(finite & torch.isfinite(norm_t))
            bad = distributed.any_rank_tensor(bad.to(torch.float32))
            self.on_update(UpdateEvent.PRE_OPTIMIZER_STEP)
            fused.found_inf = bad  # type: ignore[attr-defined]  # read by torch's Adam.step (GradScaler's hook)
            try:
                self.optimizer.step()
            finally:
                del fused.found_inf  # type: ignore[attr-defined]
            self.on_update(UpdateEvent.OPTIMIZER_STEP)
            self._end_update()
            norm, flag = torch.stack([norm_t.to(bad.device), bad]).tolist()
            return norm, flag > 0
        norm = float(grad_norm)  # a host read: the last backward must finish first
        # every rank takes the same decision: a NaN on one rank's loss skips the update everywhere
        skip = distributed.any_rank(not (bool(finite) and math.isfinite(norm)))
        self.on_update(UpdateEvent.PRE_OPTIMIZER_STEP)
        if not skip:  # no optimizer.step() otherwise: weights and Adam's state stay as they are
            self.optimizer.step()
        self.on_update(UpdateEvent.OPTIMIZER_STEP)
        self._end_update()
        return norm, skip

    def _end_update(self) -> None:
        """After the optimizer step (taken or skipped): the schedule, the gradients, the hooks' event."""
        with warnings.catch_warnings():  # a skipped first update: torch warns of a scheduler step before any
            warnings.simplefilter("ignore", UserWarning)  # optimizer step, on purpose here
            self.scheduler.step()  # the schedule counts updates, taken or skipped (as with AMP's skipped steps)
        self.optimizer.zero_grad(set_to_none=True)
        self.on_update(UpdateEvent.END)

    def _reduce_and_clip(self) -> torch.Tensor | float:
        """Gradients summed over ranks (FSDP has reduce-scattered them already), then clipped; the norm before
        clipping, as a device scalar (reading it here would make the host wait for the last backward; FSDP's
        clip returns a float)."""
        if self.s.sharded:
            return clip_grad_norm(self.params, self.s.max_grad_norm)
        if self.grad_reducer is not None:
            self.grad_reducer.finish()
        else:
            distributed.sum_gradients(self.params)
        return torch.nn.utils.clip_grad_norm_(self.params, self.s.max_grad_norm)

    def _row(self, model, batch: RolloutBatch, members: list[list[int]], m: int) -> PackedRow | None:
        """The packed row of micro-batch m (None past the last one, or for prompts with images)."""
        if m >= len(members):
            return None
        if self.context is not None:
            return self.context.pack_row(model, _pairs(batch, members[m]))
        replay = self.replayer is not None and model is self.policy  # train.router_replay: the rows' records
        routes = [(batch.routed_experts or [None] * len(batch))[r] for r in members[m]] if replay else None
        return pack_row(model, _pairs(batch, members[m]), share_prompts=self.s.share_prompts, routes=routes)

    def _replay_scope(self):
        """The policy's routers replay recorded routing inside (train.router_replay), each row's by `_use_replay`."""
        return contextlib.nullcontext() if self.replayer is None else self.replayer.active()

    def _use_replay(self, model, row: PackedRow | None) -> None:
        if self.replayer is not None and model is self.policy:
            self.replayer.use(None if row is None else row.replay)

    def _host_tensors(self, batch: RolloutBatch, idx: list[int],
                      width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, width] loss mask (0 on padding, masked completions and context tokens), engine logprobs, and
        the [B] advantages, on the device: one host array, one asynchronous copy (no synchronisation)."""
        b = len(idx)
        cols = max(width, b)  # the advantages ride in one extra row
        host = np.zeros((2 * b + 1, cols), dtype=np.float32)
        for i, r in enumerate(idx):
            n = len(batch.completion_ids[r])
            host[i, :n] = 1.0 if batch.all_tokens_trained(r) else batch.token_mask(r)
            host[b + i, :n] = batch.sampling_logprobs[r]
        host[-1, :b] = batch.advantages[idx].detach().float().cpu().numpy()
        both = host_to_device(host, self.device)
        mask, sampling = both[:b, :width], both[b: 2 * b, :width]
        if cols != width:
            mask, sampling = mask.contiguous(), sampling.contiguous()
        return mask, sampling, both[-1, :b]

    def update(self, batch: RolloutBatch, timer) -> dict[str, float]:
        if self.context is not None:  # the group's rollouts: its ranks train on the same rows, split by position
            batch = self.context.union(batch)
        n, g = len(batch), batch.group_size
        num_prompts, m = n // g, self.s.mini_batches
        # prompt k goes to mini-batch k % m: a rank's contiguous slice of the step's prompts then holds an equal
        # share of every mini-batch, so N data-parallel ranks run exactly the updates one rank runs
        groups = [[p * g + i for p in range(j, num_prompts, m) for i in range(g)] for j in range(m)]
        off_policy = self.s.mini_batches > 1 or self.s.num_iterations > 1
        all_rows = list(range(n))
        old = ref = None
        with timer("logprobs"):
            if off_policy and self.s.logprob_parity == "exact":  # the engine's are the recompute's bits
                old = sampled_old_logprobs(batch, self.device)
            if off_policy and old is None:
                with self._replay_scope():
                    old = self._logprobs_of(self.policy, batch, all_rows)
            if self.reference is not None:
                ref = self._logprobs_of(self.reference, batch, all_rows)
        sums: dict[str, float] = defaultdict(float)
        updates = 0
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's (first) update uses, as TRL logs it
        with timer("update"):
            for _ in range(self.s.num_iterations):
                for rows in groups:
                    self._mini_batch_step(batch, rows, old, ref, sums)
                    updates += 1
        skipped = sums.pop("skipped_updates", 0.0)
        metrics = {k: v / updates for k, v in sums.items()}
        metrics["learning_rate"] = lr
        metrics["skipped_updates"] = skipped  # optimiser updates of this step skipped for a non-finite value
        return metrics
