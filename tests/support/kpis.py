"""The KPI counters as the tests read them: what the domain collector exports, and the deltas not folded yet."""

from __future__ import annotations

from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agents.observability.kpis import DomainCollector
from models.db import Database


def exported(db: Database) -> dict[str, float]:
    """Every sample the domain collector exports, as ``name{label="v",...}`` -> value."""
    registry = CollectorRegistry()
    registry.register(DomainCollector(db))
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def deltas(raw: psycopg.Connection[Any]) -> int:
    (n,) = raw.execute("SELECT count(*) FROM kpi_deltas").fetchone()  # type: ignore[misc]
    return int(n)
