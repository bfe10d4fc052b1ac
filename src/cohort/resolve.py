"""The one resolver of import paths: ``"package.module:object"`` -> the object it names.

Every place a user may name their own code by a string (a data source, a reward function, a tool, a tool
parser, an environment, a policy loss, an advantage estimator) goes through `resolve_object`, so the accepted
format and the error are the same everywhere. The part after ``:`` may be dotted (``"pkg.mod:Class.method"``).

One error shape for the three ways it can fail, a `ConfigError` (so also a ValueError)::

    <field> '<spec>': <what is wrong>. Fix: <fix>

where ``<what is wrong>`` is one of "not an import path (no ':' between the module and the name)",
"Cannot import module 'm' (<reason>). Is it on PYTHONPATH?" or "Module 'm' has no attribute 'a'".

A bottom-layer module: it imports only the standard library and `cohort.errors`.
"""

from __future__ import annotations

import importlib
from typing import Any

from cohort.errors import ConfigError

SEPARATOR = ":"


def is_import_path(spec: object) -> bool:
    """Whether ``spec`` has the shape ``"module:name"`` (both parts non-empty); it says nothing of importing."""
    if not isinstance(spec, str):
        return False
    module_name, sep, attr = spec.partition(SEPARATOR)
    return bool(sep and module_name.strip() and attr.strip())


def resolve_object(spec: str, *, field: str = "import path", expects: str = "object", fix: str | None = None) -> Any:
    """The object ``spec`` (``"package.module:attr"``, attr may be dotted) names.

    field: what the message calls the value (``"import path"``, ``"loss import path"``, a config field name).
    expects: what the name after ``:`` should be (``"function"``, ``"ClassOrFactory"``), used in the default fix.
    fix: the fix the message ends with; default ``"write it as 'package.module:<expects>', with the module
        importable (on PYTHONPATH)."``

    Raises ConfigError, one shape for a missing ``:``, a module that cannot be imported and a missing
    attribute (see the module docstring).
    """
    hint = fix or f"write it as 'package.module:{expects}', with the module importable (on PYTHONPATH)."
    if not is_import_path(spec):
        raise _error(field, spec, "not an import path (no ':' between the module and the name).", hint)
    module_name, _, attr = spec.partition(SEPARATOR)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise _error(field, spec, f"Cannot import module {module_name!r} ({exc}). Is it on PYTHONPATH?",
                     hint) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise _error(field, spec, f"Module {module_name!r} has no attribute {attr!r}.", hint) from exc
    return obj


def _error(field: str, spec: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{field} {spec!r}: {problem} Fix: {fix}")
