"""The rollout side of a run: which engine samples (a `cohort serve` server, the vision group engine,
cohort's paged engine, or Hugging Face `generate` as the fallback) and how it is built, the EOS ids it stops
on, and the sampling parameters drawn from the `generation` section.
"""

from __future__ import annotations

import uuid

import torch
import torch.distributed as dist

from cohort import distributed
from cohort.config import CohortConfig
from cohort.distributed.fsdp import GatheredEngine
from cohort.engine import CohortEngine, engine_supports
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.policy.quantized import MergedCopy, MergedCopyEngine, is_4bit
from cohort.remote.client import RemoteEngine
from cohort.setup.lengths import engine_model_len
from cohort.setup.settings import replay_routes
from cohort.types import RolloutEngine, SamplingParams
from cohort.vision.model import is_vision_model
from cohort.vision.setup import build_engine as vision_engine


def sampling_params_for(cfg: CohortConfig, tokenizer, *, n: int, seed: int | None) -> SamplingParams:
    g = cfg.generation
    return SamplingParams(
        n=n, max_tokens=g.max_completion_length, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
        min_p=g.min_p, repetition_penalty=g.repetition_penalty, stop_strings=tuple(g.stop_strings),
        ignore_eos=g.ignore_eos, seed=seed)


def build_engine(cfg: CohortConfig, policy, tokenizer, device: torch.device, echo=print,
                 kv_cache_fraction: float | None = None, longest_prompt: int | None = None) -> RolloutEngine:
    """cohort's own engine whenever the architecture is supported (on the CPU too, where its shared prompt
    prefill makes it about 2x faster than `generate` for SmolLM2); else Hugging Face `generate`."""
    g = cfg.generation
    if g.placement == "server":  # a `cohort serve` process samples; rank 0 pushes the weights after each step
        echo(f"generation: on the cohort server at {g.server_address} (generation.placement=server)")
        return RemoteEngine(str(g.server_address), policy, timeout_s=g.server_timeout_s,
                            connect_timeout_s=g.server_connect_timeout_s, pusher=distributed.current().is_main,
                            session=_run_session(), liveness_timeout_s=g.server_liveness_timeout_s)

    if generate_replaced(policy):  # the user's own generate (a wrapper, a scripted stand-in): honour it
        # (prompts with images then fail in HFGenerateEngine, naming why, rather than sample without them)
        echo("generation: this model's `generate` is not transformers' own (replaced on the model or its class), "
             "so transformers' generate path samples through it (generation.engine='hf' for this run; cohort's "
             "engine would bypass it)")
        return _hf_engine(cfg, policy, tokenizer)
    if cfg.generation.engine == "hf" and is_vision_model(policy) and (cfg.agent.tools or cfg.agent.environment_factory):
        echo("generation: transformers' generate on the VLM (generation.engine=hf with tools): each turn regenerates "
             "the conversation with its images, those the tools returned included")
        return _hf_engine(cfg, policy, tokenizer)
    # a VLM the paged engine cannot run: the vision group engine (None for text models and supported VLMs)
    vlm = vision_engine(policy, tokenizer, eos_ids(tokenizer, policy), echo, cfg.generation.engine)
    if vlm is not None:
        return vlm
    choice = cfg.generation.engine
    if choice == "auto":
        choice = "cohort"
    if choice == "cohort":
        ok, why = engine_supports(policy)
        # a merged copy: a 4-bit base's (QLoRA) or LoRA on plain weights' (generation.lora_engine)
        merged = (cfg.generation.quantized_engine == "merged_bf16" if is_4bit(policy)
                  else cfg.generation.lora_engine == "merged")
        if ok and merged:
            return _merged_copy_engine(cfg, policy, tokenizer, device, echo, kv_cache_fraction, longest_prompt)
        if ok:
            return _cohort_engine(cfg, policy, policy, tokenizer, device, kv_cache_fraction, longest_prompt,
                                  cfg.generation.fuse_projections)
        echo(f"cohort engine does not support this model ({why}); falling back to Hugging Face generate")
    return _hf_engine(cfg, policy, tokenizer)


def generate_replaced(model) -> bool:
    """Whether `model.generate` is someone's replacement (set on the instance, or on its class, or a class
    defined outside transformers and peft overriding it) rather than transformers' own (or peft's, which calls
    it): then it is what samples."""
    if "generate" in vars(model):
        return True
    fn = getattr(type(model), "generate", None)
    return fn is not None and not str(getattr(fn, "__module__", "")).startswith(("transformers.", "peft."))


def _hf_engine(cfg: CohortConfig, policy, tokenizer) -> HFGenerateEngine:
    return HFGenerateEngine(policy, tokenizer, eos_token_ids=eos_ids(tokenizer, policy),
                            batch_size=cfg.generation.generation_batch_size,
                            generate_kwargs=cfg.generation.hf_generate_kwargs)


def _cohort_engine(cfg: CohortConfig, model, policy, tokenizer, device, kv_cache_fraction, longest_prompt,
                   fuse_projections) -> CohortEngine:
    """cohort's engine over `model` (the policy itself, or its merged copy) for `policy`'s EOS ids and context."""
    return CohortEngine(model, tokenizer, eos_token_ids=eos_ids(tokenizer, policy),
                        kv_cache_fraction=kv_cache_fraction or cfg.generation.kv_cache_fraction,
                        fuse_projections=fuse_projections, device=device, record_routes=replay_routes(cfg, policy),
                        max_model_len=engine_model_len(cfg, policy, longest_prompt))


def _merged_copy_engine(cfg: CohortConfig, policy, tokenizer, device, echo, kv_cache_fraction,
                        longest_prompt) -> RolloutEngine:
    """A 4-bit policy (QLoRA) with generation.quantized_engine=merged_bf16, or LoRA on plain weights with
    generation.lora_engine=merged: cohort's engine over a copy with the adapters merged (cohort.policy.quantized;
    4-bit: without fused projection copies unless asked for, they would copy the copy). When the copy cannot be
    made it says why and samples otherwise: Hugging Face generate (4-bit), the adapters in place (LoRA)."""
    four_bit = is_4bit(policy)
    setting = "generation.quantized_engine=merged_bf16" if four_bit else "generation.lora_engine=merged"
    try:
        merged = MergedCopy(policy)
    except ValueError as exc:
        if not four_bit:  # the adapters stay usable in place: say so and sample from them
            echo(f"{setting}: no merged copy of this LoRA model ({exc}); sampling from the adapters in place")
            return _cohort_engine(cfg, policy, policy, tokenizer, device, kv_cache_fraction, longest_prompt,
                                  cfg.generation.fuse_projections)
        echo(f"{setting}: no merged copy of this 4-bit model ({exc}); falling back to Hugging Face generate on "
             "the 4-bit model")
        return HFGenerateEngine(policy, tokenizer, eos_token_ids=eos_ids(tokenizer, policy),
                                batch_size=cfg.generation.generation_batch_size)
    # a 4-bit base's copy holds every weight: fused copies would copy the copy (None, auto, means off); a LoRA
    # copy holds the adapted layers, whose fused copies the engine makes as for any plain model
    fuse = bool(cfg.generation.fuse_projections) if four_bit else cfg.generation.fuse_projections
    engine = _cohort_engine(cfg, merged.model, policy, tokenizer, device, kv_cache_fraction, longest_prompt, fuse)
    what = "the 4-bit base" if four_bit else "the LoRA-adapted layers"
    echo(f"generation: cohort engine on a merged {merged.dtype_name} copy of {what} "
         f"({merged.bytes / 2**30:.2f} GiB, refreshed after each optimizer step)")
    return MergedCopyEngine(engine, merged)


def build_run_engine(cfg: CohortConfig, policy, tokenizer, device: torch.device, echo, kv_cache_fraction,
                     longest_prompt: int | None, sharded) -> RolloutEngine:
    """The run's engine: on the policy itself, or (train.sharding=fsdp, `sharded` = (mirror, gather)) on the
    engine's mirror of the sharded policy, refreshed by the gather after each optimizer step."""
    if sharded is None:
        return build_engine(cfg, policy, tokenizer, device, echo, kv_cache_fraction, longest_prompt)
    mirror, gather = sharded
    return GatheredEngine(build_engine(cfg, mirror, tokenizer, device, echo, kv_cache_fraction, longest_prompt),
                          gather)


def _run_session() -> str:
    """One id for the run, the same on every rank (rank 0's): a server serves the weights its rank 0 pushed."""
    session = [uuid.uuid4().hex]
    if distributed.current().enabled:
        dist.broadcast_object_list(session, src=0)
    return session[0]


def eos_ids(tokenizer, model=None) -> list[int]:
    """The tokenizer's EOS plus the model's generation_config ones (Qwen ends a chat turn on <|im_end|> while
    its tokenizer's EOS is <|endoftext|>: `generate` stops on both, so the engine must too)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    ids.update(extra if isinstance(extra, list | tuple) else [] if extra is None else [extra])
    return sorted(int(i) for i in ids)
