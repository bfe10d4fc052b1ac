"""A `cohort serve` address as users write it (host:port, with or without http://), checked and split.

Kept apart from the client so the config's checks can use it without importing the engine."""

from __future__ import annotations

from cohort.errors import ConfigError


def parse_address(address: str) -> tuple[str, int]:
    text = str(address).strip().removeprefix("http://").removeprefix("https://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"generation.server_address={address!r} is not valid: give host:port, e.g. "
                          "127.0.0.1:8000 (the address `cohort serve` prints)")
    return host, int(port)
