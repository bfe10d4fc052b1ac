"""Lengths against the model and the device, checked before any weight loads (issue 33).

Training, `check_lengths(cfg, policy, device, dtype)` (build_components, before the policy loads), from the
model's config.json alone (`cohort.policy.context.peek_config`; the policy's own config when one is handed in):
- the context (generation.max_model_len, else the model's, `cohort.policy.context.model_context`): the longest
  completion must leave room for a prompt, and generation.max_model_len must not exceed the model's. A prompt
  cap that does not fit beside the completion is lowered later, as before (cohort.setup.lengths);
- on a GPU, the device's memory: the update's estimate at that length (cohort.policy.memory, the terms of
  cohort.setup.memory_plan) within 90% of the device, and one sequence of prompt + completion within the KV
  pool the engine will get. Only a completion length that is the cause is refused (a shorter one fits); what
  no completion length fixes is left to the plan after the load, as are runs the estimate cannot read ahead
  (a 4-bit base, context parallelism, an architecture the estimator does not know).
Each error names the field, the value and the largest value that fits. Where the config cannot be had
without loading (a GGUF file, a named offline model), the same context check runs after the load
(cohort.setup.lengths).

Serving, `check_serve_context(...)` (`cohort serve`, before the weights load): --max-model-len against the
model's context and against what one sequence can have in the KV pool the engine will size.
"""

from __future__ import annotations

import dataclasses

import torch

from cohort import distributed
from cohort.algorithms import build_policy_loss
from cohort.config import CohortConfig
from cohort.engine.models.registry import supported_model_types
from cohort.errors import ConfigError
from cohort.policy.context import (
    CPU_KV_BUDGET,
    default_block_size,
    kv_bytes_per_token,
    kv_pool_tokens,
    largest_fitting,
    model_context,
    peek_config,
)
from cohort.policy.memory import GIB, count_lora_parameters, count_parameters, estimate_memory
from cohort.setup.lengths import context_error, longest_completion
from cohort.setup.memory_plan import micro_batch_shape


def check_lengths(cfg: CohortConfig, policy, device: torch.device, dtype: torch.dtype) -> None:
    """The training checks of the module docstring; nothing when the model's config cannot be read yet."""
    m = cfg.model
    config = getattr(policy, "config", None) if policy is not None else \
        peek_config(m.name_or_path, gguf_file=m.gguf_file, trust_remote_code=m.trust_remote_code)
    if config is None:
        return
    context, source = _context(cfg, config)
    if context is not None and longest_completion(cfg) >= context:
        raise context_error(cfg, context, source)
    free = _device_bytes(device)
    if free is not None:
        _check_memory(cfg, config, device, dtype, free, context)


def _context(cfg: CohortConfig, config) -> tuple[int | None, str]:
    """(the run's context, what sets it); generation.max_model_len above the model's own is a ConfigError."""
    native, field = model_context(config)
    chosen = cfg.generation.max_model_len
    if chosen is not None and native is not None and chosen > native:
        raise ConfigError(f"generation.max_model_len={chosen} is not valid: the model's context ({field}) is "
                          f"{native} tokens; use at most {native}, or leave it unset.")
    return (chosen, "generation.max_model_len") if chosen else (native, field)


def _device_bytes(device: torch.device) -> int | None:
    """What the run may use on the device, as the memory plan counts it (free + what this process holds); None
    on the CPU, where nothing is checked."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_allocated(device))


def _estimator(cfg: CohortConfig, config, device: torch.device, dtype: torch.dtype):
    """completion length -> the memory estimate of the run's update at it; None where it cannot be read ahead."""
    m, t, g = cfg.model, cfg.train, cfg.generation
    if getattr(m, "quantization", "none") != "none" or getattr(t, "context_parallel", 1) > 1:
        return None
    cuda = device.type == "cuda"
    try:
        lora = count_lora_parameters(config, m.lora_r, list(m.lora_target_modules)) if m.lora_r > 0 else 0
        count_parameters(config)
    except (ConfigError, KeyError, TypeError, ValueError, AttributeError):
        return None
    beta = float(getattr(build_policy_loss(cfg.loss.loss_type, cfg.loss.loss_params()), "beta", 0.0) or 0.0)
    shards = distributed.current().world_size if t.sharding == "fsdp" else None

    def estimate(completion: int):
        at = dataclasses.replace(cfg, generation=dataclasses.replace(g, max_completion_length=completion))
        tokens, completion_tokens, shared = micro_batch_shape(at)
        return estimate_memory(config, dtype=dtype, shards=shards, token_budget=tokens,
                               completion_tokens=completion_tokens, master_weights_fp32=t.master_weights,
                               gradient_checkpointing=m.gradient_checkpointing, reference_model=beta != 0.0,
                               chunk_tokens=t.logprob_chunk_tokens, lm_head_grad_fp32=t.master_weights,
                               keep_logits=t.keep_logits, optimizer_offload=t.optimizer_offload,
                               fused_logprob_kernels=cuda, kv_released_in_update=g.release_kv_during_update,
                               compiled_layers=m.compile_layers and cuda, shared_key_rows=shared, lora_params=lora)
    return estimate


def _kv_pool(cfg: CohortConfig, est, free: int) -> int:
    """Bytes of the engine's KV pool, as setup.memory_plan shares it out: kv_cache_fraction of what the model (and
    the reference, the fp32 masters) leave, at most what the update leaves."""
    held = est.weights + est.reference + est.master_weights + est.engine_weights
    left = free - held
    pending = est.optimizer if cfg.generation.release_kv_during_update else est.total - held
    room = 0.9 * left - pending
    return int(max(0.0, min(cfg.generation.kv_cache_fraction * left, room)))


def _check_memory(cfg: CohortConfig, config, device, dtype, free: int, context: int | None) -> None:
    estimate = _estimator(cfg, config, device, dtype)
    if estimate is None:
        return
    g, prompt = cfg.generation, cfg.data.max_prompt_length
    per_token = kv_bytes_per_token(config, torch.empty((), dtype=dtype).element_size())
    block = default_block_size(device.type)
    engine = g.placement != "server" and g.engine in ("auto", "cohort") and \
        getattr(config, "model_type", None) in supported_model_types()

    def sequence_kv(completion: int) -> int:  # one sequence of the engine's length, in whole blocks
        length = prompt + completion if context is None else min(context, prompt + completion)
        return -(-length // block) * block * per_token

    def update_fits(completion: int) -> bool:
        return estimate(completion).total <= 0.9 * free

    def kv_fits(trained: int, longest: int) -> bool:  # the pool is shared out after the update at `trained`
        return not engine or sequence_kv(longest) <= _kv_pool(cfg, estimate(trained), free)

    trained, evaluated = g.max_completion_length, cfg.run.eval_max_completion_length or 0
    if update_fits(trained) and kv_fits(trained, max(trained, evaluated)):
        return
    if update_fits(trained) and evaluated > trained and kv_fits(trained, trained):  # the held-out length's fault
        field, value = "run.eval_max_completion_length", evaluated
        best = largest_fitting(lambda e: kv_fits(trained, e), evaluated)
    else:
        field, value = "generation.max_completion_length", trained
        best = largest_fitting(lambda c: update_fits(c) and kv_fits(c, max(c, evaluated)), trained)
    if best is None:
        return  # no completion length fits: the memory plan names the terms to lower, after the load
    if not update_fits(trained):
        raise ConfigError(
            f"{field}={value} does not fit the device's memory: the update's estimate at data.max_prompt_length="
            f"{prompt} + {value} tokens is {estimate(trained).total / GIB:.1f} GiB, over 90% of the {free / GIB:.1f} "
            f"GiB the device has; the largest that fits is {best} (or lower train.token_budget, set "
            "model.gradient_checkpointing=true)")
    pool = _kv_pool(cfg, estimate(trained), free)
    raise ConfigError(
        f"{field}={value} does not fit the device's memory: one sequence of {prompt} + {value} tokens needs "
        f"{sequence_kv(value) / GIB:.3g} GiB of KV cache, more than the rollout engine's pool of about "
        f"{pool / GIB:.3g} GiB (generation.kv_cache_fraction={g.kv_cache_fraction} of what the model and the update "
        f"leave); the largest that fits is {best} (or raise generation.kv_cache_fraction, lower train.token_budget)")


def serve_kv_tokens(config, device: torch.device, dtype: torch.dtype, kv_cache_fraction: float) -> int | None:
    """Tokens the KV pool of `cohort serve`'s engine will hold on `device` (the model loaded, nothing else),
    as the engine sizes it; None where the weights' size cannot be read from the config."""
    per_token = kv_bytes_per_token(config, torch.empty((), dtype=dtype).element_size())
    if device.type == "cuda":
        try:
            weights = count_parameters(config) * torch.empty((), dtype=dtype).element_size()
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        free = torch.cuda.mem_get_info(device)[0] - weights
    else:
        free = CPU_KV_BUDGET  # the engine's CPU pool is a share of a fixed budget
    return kv_pool_tokens(max(0, free), kv_cache_fraction, per_token, default_block_size(device.type))


def check_served_context(config, max_model_len: int | None) -> None:
    """--max-model-len within the model's context (before the load from config.json, or after it for a model
    whose config needs the load: a GGUF file)."""
    native, field = model_context(config)
    if max_model_len is not None and native is not None and max_model_len > native:
        raise ConfigError(f"--max-model-len={max_model_len} exceeds the model's context of {native} tokens ({field}); "
                          f"the largest that fits is {native} (or leave it out: the model's context, within what "
                          "the KV cache holds)")


def check_serve_context(model: str, max_model_len: int | None, kv_cache_fraction: float, device: torch.device,
                        dtype: torch.dtype, engine: str) -> None:
    """`cohort serve --max-model-len` against the model's context and the KV pool, before the weights load."""
    if max_model_len is not None and max_model_len < 1:
        raise ConfigError(f"--max-model-len={max_model_len} must be a positive number of tokens, or left out (the "
                          "model's context, within what the KV cache holds)")
    config = peek_config(model)
    if config is None or max_model_len is None:
        return
    check_served_context(config, max_model_len)
    if engine == "hf" or getattr(config, "model_type", None) not in supported_model_types():
        return
    holds = serve_kv_tokens(config, device, dtype, kv_cache_fraction)
    if holds is not None and max_model_len > holds:
        raise ConfigError(f"--max-model-len={max_model_len} does not fit the KV cache: --kv-cache-fraction="
                          f"{kv_cache_fraction} of the memory left beside the weights holds {holds} tokens, and one "
                          f"sequence must fit; the largest that fits is {holds} (or raise --kv-cache-fraction)")
