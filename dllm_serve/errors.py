"""Errors a user can cause, each with the HTTP status it maps to."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class RequestError(ValueError):
    """A request that cannot be served as sent (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@contextmanager
def params_named(names: Mapping[str, str]) -> Iterator[None]:
    """A RequestError raised inside names its param by the route's own field (the front checks
    every prompt and length under the completion route's names, `prompt` and `max_tokens`)."""
    try:
        yield
    except RequestError as e:
        e.param = names.get(e.param or "", e.param)
        raise


class EngineDeadError(RuntimeError):
    """A child process died or failed; the engine cannot serve any more requests."""
