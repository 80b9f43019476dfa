"""The errors only :class:`~agents.client.HttpClient` raises; every other refusal is one of Keel's own errors."""

from __future__ import annotations

from agents.core.errors import KeelError, StoreError


class AccessDenied(KeelError):
    """The API refused the token: missing, unknown or revoked (401), or without the scope for this (403)."""

    def __init__(self, message: str, *, status: int) -> None:
        self.status = status
        super().__init__(message)


class ApiUnavailable(StoreError):
    """The API could not be reached or kept failing (network errors, 5xx) after every retry."""
