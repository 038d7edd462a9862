"""Errors a user can cause, each with the HTTP status it maps to."""

from __future__ import annotations


class RequestError(ValueError):
    """A request that cannot be served as sent (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class EngineDeadError(RuntimeError):
    """A child process died or failed; the engine cannot serve any more requests."""
