"""The checks of generation.logprob_parity that need no model: exact runs on cohort's engine in this process, over
whole weights, with Triton installed (cohort.forward.invariant checks the model at set-up). Its packed rows keep a
prompt copy per completion (setup/settings turns train.share_prompts off: the batch-invariant attention does not
read the shared-prompt layout yet)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cohort.errors import ConfigError
from cohort.forward.invariant import kernels

if TYPE_CHECKING:
    from cohort.config.tree import CohortConfig


def check_logprob_parity(cfg: CohortConfig) -> None:
    """generation.logprob_parity: a mode, and for exact every setting it cannot run with (named, with the fix)."""
    g, t, m = cfg.generation, cfg.train, cfg.model
    mode = g.logprob_parity
    if mode not in ("fast", "exact"):
        raise ConfigError(f"generation.logprob_parity={mode!r} is not valid: use 'fast' or 'exact'.")
    if mode == "fast":
        return
    refusals = (
        (g.engine == "hf", f"generation.engine={g.engine!r} samples with transformers' generate, which has no "
                           "batch-invariant forward; use generation.engine=auto or cohort"),
        (g.placement != "colocate", f"generation.placement={g.placement!r}: the served engine decides its own "
                                    "kernels; use generation.placement=colocate"),
        (t.sharding == "fsdp", "train.sharding=fsdp runs the packed pass through FSDP's root method; use "
                               "train.sharding=none"),
        (t.context_parallel > 1, f"train.context_parallel={t.context_parallel} splits a row over ranks; use 1"),
        (bool(getattr(t, "async_rollouts", False)), "train.async_rollouts=true samples with weights a step behind, "
                                                    "so the engine's logprobs are not the update's old ones; set "
                                                    "train.async_rollouts=false"),
        (m.lora_r > 0 or m.quantization != "none", "LoRA adapters and 4-bit weights are not plain matmuls of the "
                                                  "batch-invariant kernels; use model.lora_r=0 and "
                                                  "model.quantization=none"),
        (kernels.triton is None, "its kernels need Triton (pip install triton; it comes with torch on CUDA)"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"generation.logprob_parity='exact' is not valid: {why}, or set "
                              "generation.logprob_parity=fast.")
