"""`cohort serve`'s authentication: one shared secret, checked on every route.

The key comes from `--api-key KEY`, else the environment variable COHORT_API_KEY, else it is drawn at start and
printed once. Every request must carry `Authorization: Bearer KEY` (OpenAI's form, so OpenAI clients send it
as their api_key); anything else is answered 401 before the body is read. The trainer's client reads the same
variable (cohort.remote.client). `--api-key none` turns the check off, with a warning: then any process that
reaches the port can push weights the server goes on to serve.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Mapping

from cohort.errors import CohortError
from cohort.remote.client import API_KEY_ENV

OFF = "none"  # --api-key none: no authentication
SHORT = 16  # a key shorter than this is accepted with a warning


def resolve_key(flag: str | None, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(key, where it came from: "--api-key", COHORT_API_KEY, "generated" or "off"); key None: no check."""
    if flag is not None:
        if flag.strip().lower() == OFF:
            return None, "off"
        if not flag.strip():
            raise CohortError("--api-key '' is empty: give a key, leave the option out (one is generated), or "
                              "--api-key none to turn authentication off")
        return flag, "--api-key"
    value = environ.get(API_KEY_ENV, "")
    if value.strip().lower() == OFF:
        raise CohortError(f"{API_KEY_ENV}={value!r}: to turn authentication off pass --api-key none explicitly")
    if value.strip():
        return value, API_KEY_ENV
    return secrets.token_urlsafe(32), "generated"


def refusal(header: str | None, key: str | None) -> str | None:
    """Why a request's Authorization header does not carry `key` (None: it does, or there is no key). The
    comparison takes the same time wherever the keys differ (hmac.compare_digest)."""
    if key is None:
        return None
    if not header:
        return "no Authorization header"
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return "the Authorization header is not 'Bearer <key>'"
    if not hmac.compare_digest(given.strip().encode("utf-8", "replace"), key.encode("utf-8")):
        return "wrong API key"
    return None


def announcement(key: str | None, source: str, where: str) -> tuple[str, str]:
    """(stdout line, stderr warning) to print at start; either may be empty."""
    if key is None:
        return "", (f"cohort serve: WARNING: authentication is OFF (--api-key none). Any process that reaches "
                    f"{where} can generate AND PUSH WEIGHTS that this server then serves to everyone. Use it only "
                    "on a machine and network you alone use; leave --api-key out to get a key.")
    warning = ""
    if len(key) < SHORT:
        warning = (f"cohort serve: WARNING: the API key from {source} has {len(key)} characters; use at least "
                   f"{SHORT} random ones (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if source != "generated":
        return f"cohort serve: API key from {source}", warning
    return (f"cohort serve: API key (generated): {key}  -- clients send 'Authorization: Bearer <key>'; give it to "
            f"the trainer as {API_KEY_ENV}=<key>", warning)
