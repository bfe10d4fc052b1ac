"""What a call to a `cohort serve` server raises (named, so the trainer can say which server and phase)."""

from __future__ import annotations

from cohort.errors import CohortError


class ServerError(CohortError):
    """The server answered with an error."""


class ServerAuthError(ServerError):
    """The server refused the request's API key (HTTP 401): COHORT_API_KEY (or api_key=) is missing or wrong."""


class ServerUnavailable(ServerError):
    """The server did not answer (refused, reset, or silent past the timeout)."""


class StaleServer(ServerError):
    """The server does not hold the version a request needs (it restarted, or no push arrived in time)."""

    def __init__(self, message: str, server_id: str | None) -> None:
        super().__init__(message)
        self.server_id = server_id


class SessionGone(ServerError):
    """The server no longer holds a conversation's kept KV (HTTP 410: its session timed out, was evicted
    under --max-sessions, closed, or the server restarted): re-send the whole conversation."""
