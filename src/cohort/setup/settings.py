"""The config read once into the typed records the step's stages take: the update's `UpdateSettings`, and the
engine's abilities checked against what the config asks of it.

The update never sees the config tree: its settings come from `train.*`, `generation.*` and `loss`-independent
knobs under three names, gathered here into one record."""

from __future__ import annotations

from cohort.config import CohortConfig
from cohort.types import EngineAbilities
from cohort.update import UpdateSettings


def update_settings(cfg: CohortConfig) -> UpdateSettings:
    t = cfg.train
    return UpdateSettings(
        mini_batches=t.mini_batches, num_iterations=t.num_iterations, token_budget=t.token_budget,
        temperature=cfg.generation.temperature or 1.0, max_grad_norm=t.max_grad_norm,
        max_completion_length=cfg.generation.max_completion_length, chunk_tokens=t.logprob_chunk_tokens,
        lm_head_grad_fp32=t.master_weights, keep_logits=t.keep_logits, sharded=t.sharding == "fsdp",
        reduce_every_micro_batch=t.fsdp_reduce_every_micro_batch,
        max_nonfinite_updates=t.max_nonfinite_updates, share_prompts=t.share_prompts)


def check_engine_abilities(cfg: CohortConfig, engine: object, echo=print) -> EngineAbilities:
    """The engine's abilities, once; a setting that needs one the engine lacks says what happens instead."""
    abilities = EngineAbilities.of(engine)
    if cfg.generation.release_kv_during_update and not abilities.releases_kv:
        echo(f"generation.release_kv_during_update=true: the {type(engine).__name__} engine keeps no KV pool of "
             "its own to release, so the setting has no effect in this run")
    return abilities
