"""The root of Keel's errors. It lives here, below everything, so that errors raised in ``models/`` (which imports
nothing of ``agents/``) share it; ``agents.core.errors`` re-exports it with the rest of the hierarchy."""

from __future__ import annotations


class KeelError(Exception):
    """Keel could not do what was asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())
