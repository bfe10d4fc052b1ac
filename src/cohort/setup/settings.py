"""The config read once into the typed records the step's stages take: the update's `UpdateSettings`, and the
engine's abilities checked against what the config asks of it (router replay among them: `replay_routes`).

The update never sees the config tree: its settings come from `train.*`, `generation.*` and `loss`-independent
knobs under three names, gathered here into one record (and the router loss's coefficient, which needs the policy's
config when it is left to the model)."""

from __future__ import annotations

from cohort.config import CohortConfig
from cohort.errors import ConfigError
from cohort.forward.router_replay import routers
from cohort.streaming import resident_engine
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
        max_nonfinite_updates=t.max_nonfinite_updates,
        share_prompts=t.share_prompts and cfg.generation.logprob_parity != "exact",  # exact: plain rows only
        router_aux_loss_coef=_router_coef(cfg, policy), context_parallel=t.context_parallel,
        router_replay=t.router_replay, logprob_parity=cfg.generation.logprob_parity)


def _router_coef(cfg: CohortConfig, policy) -> float:
    """router_aux_loss_coef, refused with context parallelism: the load-balancing loss is a product of means over
    the row's tokens, which no rank of a group holds alone."""
    coef = router_aux_loss_coef(cfg, policy)
    if coef > 0 and cfg.train.context_parallel > 1:
        raise ConfigError(f"train.context_parallel={cfg.train.context_parallel} is not supported with the router "
                          f"load-balancing loss (loss.router_aux_loss_coef resolves to {coef} for this "
                          "mixture-of-experts model); set loss.router_aux_loss_coef=0.0 or train.context_parallel=1.")
    return coef


def check_engine_abilities(cfg: CohortConfig, engine: object, echo=print) -> EngineAbilities:
    """The engine's abilities, once; a setting that needs one the engine lacks says what happens instead."""
    abilities = EngineAbilities.of(engine)
    if cfg.train.router_replay and not getattr(engine, "records_routes", False):
        raise ConfigError(f"train.router_replay=true is not valid: the {type(engine).__name__} engine built for this "
                          "model records no routing (only cohort's engine does, on the mixture-of-experts families it "
                          "runs: Qwen3-MoE); use such a model with generation.engine=auto or cohort, or set "
                          "train.router_replay=false")
    if cfg.train.async_rollouts and resident_engine(engine) is None:
        raise ConfigError(f"train.async_rollouts=true is not valid: the {type(engine).__name__} engine built for this "
                          "model cannot keep sequences between steps (only cohort's engine does); use a model it runs "
                          "with generation.engine=auto or cohort, or set train.async_rollouts=false")
    if cfg.generation.release_kv_during_update and not abilities.releases_kv:
        echo(f"generation.release_kv_during_update=true: the {type(engine).__name__} engine keeps no KV pool of "
             "its own to release, so the setting has no effect in this run")
    return abilities


def replay_routes(cfg: CohortConfig, policy) -> bool:
    """train.router_replay, checked against the policy before an engine is built for it: a model without routed-experts
    layers has no routing to replay, and a context-parallel row is split over ranks the replayed rows are not."""
    if not cfg.train.router_replay:
        return False
    if not routers(policy):
        raise ConfigError(f"train.router_replay=true is not valid: {type(policy).__name__} has no mixture-of-experts "
                          "layers (no router whose choices could be replayed); set train.router_replay=false")
    cp = getattr(cfg.train, "context_parallel", 1)
    if cp > 1:
        raise ConfigError(f"train.router_replay=true is not supported with train.context_parallel={cp} (each rank "
                          "holds part of a row, the recorded routing is laid out for whole rows); set "
                          "train.context_parallel=1 or train.router_replay=false")
    return True
