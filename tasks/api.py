"""The HTTP API with Celery's publisher: a submit's first job goes to the broker at once, as ``Client`` with a
publisher does. ``keel serve`` runs :func:`create` under uvicorn (``factory=True``: each worker process builds its
own app, database pool and listener)."""

from __future__ import annotations

from fastapi import FastAPI

from agents.ingress.app import create_app
from models.settings import Settings
from tasks.app import publisher


def create() -> FastAPI:
    return create_app(Settings(), publisher=publisher())
