"""The learning half of a GRPO step: rollouts -> policy update.

`PolicyUpdater.update` takes a `RolloutBatch`, splits it into `mini_batches` optimiser updates of whole
groups, and passes over them `num_iterations` times. Each mini-batch is cut into micro-batches by a token
budget (packed, padding-free forward), and every micro-batch's loss is normalised by the mini-batch's
*global* token and sequence counts, so gradient accumulation gives exactly the whole-batch gradient for
every loss type. The updater never looks at the loss type: the loss object owns its maths.

Old logprobs are computed only when the update is off-policy (several mini-batches or iterations); on
policy, the loss uses the current logprobs detached, exactly as TRL does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cohort import distributed
from cohort.algorithms import LossInputs, reduce_metrics
from cohort.packing import packed_forward_logprobs, split_micro_batches
from cohort.rollout import RolloutBatch


@dataclass
class UpdateSettings:
    mini_batches: int
    num_iterations: int
    token_budget: int
    temperature: float
    max_grad_norm: float
    max_completion_length: int
    num_generations: int
    chunk_tokens: int = 4096  # logprob kernel chunk (train.logprob_chunk_tokens)
    lm_head_grad_fp32: bool = True  # False with train.master_weights=false: the low-memory setting


def pad_rows(rows: Sequence[torch.Tensor], width: int, value: float = 0.0) -> torch.Tensor:
    out = rows[0].new_full((len(rows), width), value)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


class PolicyUpdater:
    def __init__(self, policy, optimizer, scheduler, loss_fn, settings: UpdateSettings, *, reference=None,
                 device: torch.device | str = "cpu"):
        self.policy, self.optimizer, self.scheduler = policy, optimizer, scheduler
        self.loss_fn, self.s, self.reference, self.device = loss_fn, settings, reference, torch.device(device)

    # -- logprobs of fixed models (no grad) ------------------------------------------------------------
    @torch.no_grad()
    def _logprobs_of(self, model, batch: RolloutBatch, rows: list[int]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        lengths = [len(batch.prompt_ids[r]) + len(batch.completion_ids[r]) for r in rows]
        for micro in split_micro_batches(lengths, self.s.token_budget):
            idx = [rows[i] for i in micro]
            packed = packed_forward_logprobs(
                model, [(batch.prompt_ids[r], batch.completion_ids[r]) for r in idx],
                temperature=self.s.temperature, compute_entropy=False, chunk_tokens=self.s.chunk_tokens)
            out.update({r: lp.float() for r, (lp, _) in zip(idx, packed.split())})
        return out

    # -- one optimiser update ------------------------------------------------------------------------------
    def _mini_batch_step(self, batch: RolloutBatch, rows: list[int], old: dict | None, ref: dict | None,
                         sums: dict[str, float]) -> None:
        """One optimiser update over `rows`; adds its reduced metrics into `sums`.

        Counts, masks and engine logprobs are built on the host from the rollout's lists and sent in one copy
        per micro-batch: nothing in the micro-batch loop waits for the GPU.
        """
        # normalisers of the whole mini-batch, summed over data-parallel ranks
        num_tokens = distributed.all_sum(sum(len(batch.completion_ids[r]) for r in rows if batch.loss_mask_keep[r]))
        num_sequences = int(distributed.all_sum(len(rows)))
        lengths = [len(batch.prompt_ids[r]) + len(batch.completion_ids[r]) for r in rows]
        self.policy.train()
        parts: list[dict] = []
        for micro in split_micro_batches(lengths, self.s.token_budget):
            idx = [rows[i] for i in micro]
            width = max(len(batch.completion_ids[r]) for r in idx)
            mask, sampling = self._host_tensors(batch, idx, width)
            packed = packed_forward_logprobs(
                self.policy, [(batch.prompt_ids[r], batch.completion_ids[r]) for r in idx],
                temperature=self.s.temperature, compute_entropy=True, chunk_tokens=self.s.chunk_tokens,
                lm_head_grad_fp32=self.s.lm_head_grad_fp32)
            inputs = LossInputs(
                logprobs=packed.padded("logprobs"),
                old_logprobs=None if old is None else pad_rows([old[r] for r in idx], width),
                advantages=batch.advantages[idx].to(self.device, torch.float32),
                mask=mask,
                ref_logprobs=None if ref is None else pad_rows([ref[r] for r in idx], width),
                sampling_logprobs=sampling,
                entropy=packed.padded("entropy"),  # with grad: the entropy bonus (entropy_coef) needs it
                num_tokens=max(num_tokens, 1), num_sequences=num_sequences,
                max_completion_length=self.s.max_completion_length,
            )
            out = self.loss_fn(inputs)
            out.loss.backward()
            parts.append(out.metrics)
        local = reduce_metrics(parts)  # partial sums of this rank -> summed over ranks (min/max by min/max)
        for k, v in distributed.reduce_metrics(local, summed=tuple(local)).items():
            sums[k] += float(v)
        distributed.sum_gradients(self.policy.parameters())
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.s.max_grad_norm)
        sums["grad_norm"] += float(norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _host_tensors(self, batch: RolloutBatch, idx: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, width] loss mask (0 on padding and on masked completions) and engine logprobs, on the device."""
        mask = torch.zeros(len(idx), width)
        sampling = torch.zeros(len(idx), width)
        for i, r in enumerate(idx):
            n = len(batch.completion_ids[r])
            mask[i, :n] = 1.0 if batch.loss_mask_keep[r] else 0.0
            sampling[i, :n] = torch.tensor(batch.sampling_logprobs[r], dtype=torch.float32)
        return mask.to(self.device, non_blocking=True), sampling.to(self.device, non_blocking=True)

    def update(self, batch: RolloutBatch, timer) -> dict[str, float]:
        n, g = len(batch), self.s.num_generations
        num_prompts = n // g
        per_mb = num_prompts // self.s.mini_batches
        groups = [list(range(i * per_mb * g, (i + 1) * per_mb * g)) for i in range(self.s.mini_batches)]
        off_policy = self.s.mini_batches > 1 or self.s.num_iterations > 1
        all_rows = list(range(n))
        old = ref = None
        with timer("logprobs"):
            if off_policy:
                old = self._logprobs_of(self.policy, batch, all_rows)
            if self.reference is not None:
                ref = self._logprobs_of(self.reference, batch, all_rows)
        sums: dict[str, float] = defaultdict(float)
        updates = 0
        with timer("update"):
            for _ in range(self.s.num_iterations):
                for rows in groups:
                    self._mini_batch_step(batch, rows, old, ref, sums)
                    updates += 1
        metrics = {k: v / updates for k, v in sums.items()}
        metrics["learning_rate"] = self.scheduler.get_last_lr()[0]
        return metrics
