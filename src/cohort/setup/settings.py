"""The config read once into the typed records the step's stages take: the update's `UpdateSettings`, and the
engine's abilities checked against what the config asks of it.

The update never sees the config tree: its settings come from `train.*`, `generation.*` and `loss`-independent
knobs under three names, gathered here into one record (and the router loss's coefficient, which needs the policy's
config when it is left to the model)."""

from __future__ import annotations

from cohort.config import CohortConfig
from cohort.errors import ConfigError
from cohort.types import EngineAbilities
from cohort.update import UpdateSettings

# what marks a mixture-of-experts config (TRL asks for `output_router_logits`; Qwen3-MoE has all of them)
_MOE_KEYS = ("output_router_logits", "router_aux_loss_coef", "num_experts", "num_local_experts")


def router_aux_loss_coef(cfg: CohortConfig, policy=None) -> float:
    """loss.router_aux_loss_coef as TRL means it: None -> the policy config's own coefficient (Qwen3-MoE: 0.001;
    0.0 for a dense model), a number -> that coefficient, 0.0 -> off. A coefficient > 0 for a model without
    routers is an error (as in TRL): there is no load-balancing loss to weight."""
    coef = cfg.loss.router_aux_loss_coef
    config = getattr(policy, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    moe = text is not None and any(hasattr(text, key) for key in _MOE_KEYS)
    if coef is None:
        return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0) if moe else 0.0
    if coef and not moe:
        raise ConfigError(f"loss.router_aux_loss_coef={coef!r} is not valid: {type(policy).__name__} is not a "
                          "mixture-of-experts model, so there is no router load-balancing loss to weight; leave it "
                          "unset (null) or 0.0.")
    return float(coef)


def update_settings(cfg: CohortConfig, policy=None) -> UpdateSettings:
    """The update's settings; `policy` (the loaded model) resolves loss.router_aux_loss_coef=None to its own
    coefficient."""
    t = cfg.train
    return UpdateSettings(
        mini_batches=t.mini_batches, num_iterations=t.num_iterations, token_budget=t.token_budget,
        temperature=cfg.generation.temperature or 1.0, max_grad_norm=t.max_grad_norm,
        max_completion_length=cfg.generation.max_completion_length, chunk_tokens=t.logprob_chunk_tokens,
        lm_head_grad_fp32=t.master_weights, keep_logits=t.keep_logits, sharded=t.sharding == "fsdp",
        reduce_every_micro_batch=t.fsdp_reduce_every_micro_batch,
        max_nonfinite_updates=t.max_nonfinite_updates, share_prompts=t.share_prompts,
        router_aux_loss_coef=router_aux_loss_coef(cfg, policy))


def check_engine_abilities(cfg: CohortConfig, engine: object, echo=print) -> EngineAbilities:
    """The engine's abilities, once; a setting that needs one the engine lacks says what happens instead."""
    abilities = EngineAbilities.of(engine)
    if cfg.generation.release_kv_during_update and not abilities.releases_kv:
        echo(f"generation.release_kv_during_update=true: the {type(engine).__name__} engine keeps no KV pool of "
             "its own to release, so the setting has no effect in this run")
    return abilities
