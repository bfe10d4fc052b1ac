"""A run's memory plan: the estimate sized from its config and its loaded model, the fit check, the KV share.

`cohort.policy.memory` is the arithmetic on an architecture; this module feeds it what a run will actually do (the
largest micro-batch the update cuts, LoRA's trainable share, the rollout engine's pool as built) and decides,
on a GPU, whether the run fits and how much free memory the engine's KV cache may take.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from cohort import distributed
from cohort.config import CohortConfig
from cohort.errors import ConfigError
from cohort.policy.memory import check_fits, estimate_memory
from cohort.policy.quantized import copy_bytes, is_4bit, lora_copy_bytes, weight_bytes


def plan_memory(cfg: CohortConfig, policy, device: torch.device, with_reference: bool, echo, *,
                  dtype: torch.dtype | None = None, longest_prompt: int | None = None) -> tuple[float, Any]:
    """Print what training will need; on a GPU, stop before any work when it cannot fit. Returns the share of
    free memory the engine may take for its KV cache *after* the trainer's needs (at most
    generation.kv_cache_fraction), so the engine's pool never starves the update into an out-of-memory, and
    the estimate (cohort.policy.memory.MemoryEstimate, its kv_cache term the pool that share buys; None when the
    architecture cannot be read)."""
    fraction = cfg.generation.kv_cache_fraction
    tokens, completion_tokens, shared_key_rows = micro_batch_shape(cfg, longest_prompt)
    cp = cfg.train.context_parallel
    if cp > 1:  # each rank of a group runs 1/cp of a row, and keeps the K/V rows it gathers from the others
        tokens, completion_tokens, shared_key_rows = -(-tokens // cp), -(-completion_tokens // cp), tokens - tokens // cp
    try:
        sharded = cfg.train.sharding == "fsdp"
        dtype = dtype or next(policy.parameters()).dtype  # the compute dtype (sharded masters are fp32)
        est = estimate_memory(policy.config, dtype=dtype, shards=distributed.current().world_size if sharded else None,
                              token_budget=tokens, completion_tokens=completion_tokens,
                              master_weights_fp32=cfg.train.master_weights,
                              gradient_checkpointing=cfg.model.gradient_checkpointing, reference_model=with_reference,
                              chunk_tokens=cfg.train.logprob_chunk_tokens,
                              lm_head_grad_fp32=cfg.train.master_weights, keep_logits=cfg.train.keep_logits,
                              optimizer_offload=cfg.train.optimizer_offload,
                              fused_logprob_kernels=device.type == "cuda",
                              kv_released_in_update=cfg.generation.release_kv_during_update,
                              compiled_layers=cfg.model.compile_layers and device.type == "cuda",
                              shared_key_rows=shared_key_rows,
                              lora_params=_trainable_params(policy) if cfg.model.lora_r > 0 else 0)
    except (KeyError, TypeError, ValueError, AttributeError):  # an architecture the estimator cannot read
        return fraction, None
    est, copy = _engine_copy_terms(cfg, est, policy, with_reference)
    if device.type != "cuda":
        return fraction, est
    free, _ = torch.cuda.mem_get_info(device)
    check_fits(est, free + torch.cuda.memory_allocated(device))  # as if our own weights were not loaded yet
    # already on the device: weights, the reference copy, the optimiser's fp32 masters (made with it);
    # allocated later: gradients, Adam moments (first step), activations, logprob chunks
    pending = est.total - est.weights - est.reference - est.master_weights - est.engine_weights
    if cfg.generation.release_kv_during_update:
        # the pool is freed while the update runs: generation only shares memory with the Adam moments
        pending = est.optimizer
    room = 0.9 * free - pending - copy
    if room < 0.02 * free:
        raise ConfigError(f"generation.kv_cache_fraction={fraction}: after the update's estimated "
                          f"{pending / 2**30:.1f} GiB, {max(room, 0) / 2**30:.2f} GiB are left for the rollout "
                          "engine's KV cache; lower train.token_budget, set model.gradient_checkpointing=true "
                          "or use a smaller model.")
    free -= copy  # the engine takes its share of what is free once a 4-bit base's merged copy is made
    if room / free < fraction:
        echo(f"kv cache: generation.kv_cache_fraction={fraction} lowered to {room / free:.2f} so the update fits")
        fraction = room / free
    echo(f"kv cache: {fraction * free / 2**30:.1f} GiB for the rollout engine")
    return fraction, est


def _engine_copy_terms(cfg: CohortConfig, est, policy, with_reference: bool):
    """A 4-bit base (QLoRA): the weights and the reference as loaded (packed 4-bit), not P x dtype bytes, and the
    engine's merged copy (generation.quantized_engine=merged_bf16) in engine_weights; LoRA on plain weights with
    generation.lora_engine=merged: that copy of the adapted layers. Returns (the estimate, the copy's bytes, which
    the engine allocates after the plan: 0 for other models)."""
    if not is_4bit(policy):
        if cfg.generation.lora_engine != "merged":
            return est, 0
        copy = lora_copy_bytes(policy)  # generation.lora_engine=merged: the adapted layers once more
        return replace(est, engine_weights=est.engine_weights + copy), copy
    weights = weight_bytes(policy)
    merged = cfg.generation.quantized_engine == "merged_bf16" and cfg.generation.engine != "hf"
    copy = copy_bytes(policy) if merged else 0
    return replace(est, weights=weights, reference=weights if with_reference else 0,
                   engine_weights=est.engine_weights + copy), copy


def _trainable_params(policy) -> int:
    """Parameters with gradients (under LoRA: the adapters); a DTensor shard counts its whole (global) size."""
    return sum(p.numel() for p in policy.parameters() if p.requires_grad)


def micro_batch_tokens(cfg: CohortConfig, longest_prompt: int | None = None) -> tuple[int, int]:
    """(tokens, completion tokens) of the largest micro-batch an update can make when every completion reaches
    generation.max_completion_length and every prompt is as long as the longest encoded one
    (data.max_prompt_length when not known): the activations and logprob chunk the memory estimate sizes.
    A mini-batch's rollouts are spread evenly over as few micro-batches of train.token_budget tokens as hold them
    (cohort.forward.micro_batches.split_micro_batches), so a step smaller than the budget is one micro-batch of its size."""
    tokens, completion, _ = micro_batch_shape(cfg, longest_prompt)
    return tokens, completion


def micro_batch_shape(cfg: CohortConfig, longest_prompt: int | None = None) -> tuple[int, int, int]:
    """micro_batch_tokens, and the key rows that the attention of a shared-prompt row gathers besides
    (train.share_prompts: every completion reads its prompt's keys again; 0 without sharing). With shared
    prompts a unit is a prompt and as many of its completions as fit the budget
    (cohort.forward.micro_batches.split_grouped_micro_batches), so a micro-batch carries more completion tokens."""
    g, t = cfg.generation, cfg.train
    # data-parallel ranks: a context-parallel group trains its ranks' prompts together, in rows it splits
    ranks = max(1, distributed.current().world_size // max(1, cfg.train.context_parallel))
    prompts = max(1, -(-t.prompts_per_step // (ranks * t.mini_batches)))
    completion = max(g.max_completion_length, 1)
    prompt = longest_prompt or cfg.data.max_prompt_length
    members = 1  # completions per unit
    if t.share_prompts and g.num_generations > 1:
        members = max(1, min(g.num_generations, (t.token_budget - prompt) // completion))
    unit = prompt + members * completion
    units = prompts * -(-g.num_generations // members)
    fits = max(1, t.token_budget // unit)  # whole units per micro-batch (a longer one sits alone)
    count = -(-units // fits)
    per_micro = -(-units // count)
    gathered = per_micro * members * prompt if members > 1 else 0
    return per_micro * unit, per_micro * members * completion, gathered


def engine_memory(engine) -> tuple[int, int]:
    """(KV pool, fused QKV / gate-up weight copies) in bytes of cohort's rollout engine, as built; (0, 0) for
    Hugging Face generate, whose cache grows per call instead."""
    runner = getattr(engine, "runner", None)
    if runner is None or not hasattr(runner, "bytes_per_block"):
        return 0, 0
    kv = (runner.num_blocks + 1) * runner.bytes_per_block()  # + the scratch block of CUDA-graph padding
    copies = [t for group in getattr(runner.net, "fused", ()) for t in group if isinstance(t, torch.Tensor)]
    return kv, sum(t.numel() * t.element_size() for t in copies)
