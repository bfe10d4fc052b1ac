"""The one table of policy-loss names, and how to build a loss from a name and parameters.

A name picks a variant class (which owns its parameters) and the aggregation it implies:

================================  ==============  ===========================  ==============================
name                              class           aggregation                  paper / origin
================================  ==============  ===========================  ==============================
``grpo``                          ClippedLoss     seq-mean-token-mean          arXiv:2402.03300
``dapo`` (default)                ClippedLoss     token-mean                   arXiv:2503.14476
``bnpo``                          ClippedLoss     token-mean (global: = dapo)  TRL ``bnpo``
``dr_grpo``                       ClippedLoss     seq-mean-token-sum-norm      arXiv:2503.20783
``luspo``                         ClippedLoss     seq-mean-token-sum           arXiv:2602.05261
``cispo``                         CISPOLoss       token-mean                   arXiv:2506.13585, 2510.13786
``sapo``                          SAPOLoss        seq-mean-token-mean          arXiv:2511.20347
``vespo``                         VESPOLoss       token-mean                   arXiv:2602.10693
``token-mean`` ...                ClippedLoss     the name itself              verl ``loss_agg_mode``
================================  ==============  ===========================  ==============================

User code plugs in by import path, ``"my_pkg.losses:MyLoss"``, naming a class or factory that takes the
parameters as keywords and returns a callable ``LossInputs -> LossOutput``; no package edit needed.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

from cohort.resolve import resolve_object

from .base import PolicyLoss
from .loss_io import LossInputs, LossOutput
from .variants import CISPOLoss, ClippedLoss, SAPOLoss, VESPOLoss

PolicyLossFn = Callable[[LossInputs], LossOutput]

DEFAULT_LOSS = "dapo"

# name -> (class, parameters the name fixes by default; the user may still override them)
LOSS_TABLE: dict[str, tuple[type[PolicyLoss], dict[str, Any]]] = {
    "grpo": (ClippedLoss, {"aggregation": "seq-mean-token-mean"}),
    "dapo": (ClippedLoss, {"aggregation": "token-mean"}),
    "bnpo": (ClippedLoss, {"aggregation": "token-mean"}),
    "dr_grpo": (ClippedLoss, {"aggregation": "seq-mean-token-sum-norm"}),
    "luspo": (ClippedLoss, {"aggregation": "seq-mean-token-sum"}),
    "cispo": (CISPOLoss, {"aggregation": "token-mean"}),
    "sapo": (SAPOLoss, {"aggregation": "seq-mean-token-mean"}),
    "vespo": (VESPOLoss, {"aggregation": "token-mean"}),
    # verl's loss_agg_mode names, all on the clipped surrogate
    "token-mean": (ClippedLoss, {"aggregation": "token-mean"}),
    "seq-mean-token-mean": (ClippedLoss, {"aggregation": "seq-mean-token-mean"}),
    "seq-mean-token-sum": (ClippedLoss, {"aggregation": "seq-mean-token-sum"}),
    "seq-mean-token-sum-norm": (ClippedLoss, {"aggregation": "seq-mean-token-sum-norm"}),
}

# The names TRL's GRPOConfig.loss_type accepts (all of them are in LOSS_TABLE).
TRL_LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo")


def list_policy_losses() -> list[str]:
    """Every registered loss name."""
    return list(LOSS_TABLE)


def _unknown(kind: str, value: str, known: list[str], fix: str) -> ValueError:
    close = difflib.get_close_matches(value, known, n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"{kind} {value!r} is not known.{hint} {fix}")


def _load_import_path(path: str) -> Callable[..., Any]:
    return resolve_object(path, field="loss import path", expects="ClassOrFactory")


def policy_loss_parameters(name: str) -> dict[str, Any]:
    """The parameters of loss ``name`` with their defaults (for registered names and dataclass plug-ins)."""
    cls, fixed = _resolve_class(name)
    if cls is None or not dataclasses.is_dataclass(cls):
        return {}
    defaults = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return {**defaults, **fixed}


def _resolve_class(name: str) -> tuple[Any, dict[str, Any]]:
    if name in LOSS_TABLE:
        cls, fixed = LOSS_TABLE[name]
        return cls, dict(fixed)
    if ":" in name:
        return _load_import_path(name), {}
    raise _unknown("policy loss", name, list(LOSS_TABLE),
                   "Use one of the registered names (cohort.algorithms.list_policy_losses()) or an import path "
                   "'package.module:ClassOrFactory'.")


def get_policy_loss(name: str = DEFAULT_LOSS, **params: Any) -> PolicyLossFn:
    """Build the loss called ``name`` (registered, or ``"pkg.module:ClassOrFactory"``) with ``params``.

    Unknown parameter names raise ValueError with a "did you mean" suggestion. See the module table for the
    formula each name implements.
    """
    factory, fixed = _resolve_class(name)
    if dataclasses.is_dataclass(factory):
        allowed = [f.name for f in dataclasses.fields(factory)]
        for key in params:
            if key not in allowed:
                raise _unknown(f"parameter of loss {name!r}:", key, allowed,
                               f"Parameters of {name!r}: {', '.join(sorted(allowed))}.")
    loss = factory(**{**fixed, **params})
    if not callable(loss):
        raise TypeError(f"loss {name!r} built a {type(loss).__name__}, which is not callable on LossInputs.")
    return loss


def build_policy_loss(name: str, params: Mapping[str, Any] | None = None) -> PolicyLossFn:
    """Build a loss from a flat mapping of config values (e.g. the user's ``loss:`` section).

    ``None`` values mean "unset" and are dropped, so the loss's own default applies (this is how cispo's
    ``epsilon_high`` gets its sound default of 5.0). Every other key must be a parameter of the loss:
    nothing is silently ignored, and a misspelt key raises with a "did you mean" suggestion.
    """
    given = {k: v for k, v in (params or {}).items() if v is not None}
    return get_policy_loss(name, **given)
