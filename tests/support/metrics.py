"""Helpers for the metrics tests: one unit of work of each kind, the names a registry exports, and the check that a
collector exports only the contract's names (agents/observability/names.py) with their types and labels."""

from __future__ import annotations

from prometheus_client.registry import Collector

from agents.core.observe import observe
from agents.observability.names import ALL, MetricName


def one_of_each_kind() -> None:
    """One unit of work of each observed kind, as the call sites run them."""
    with observe("transition", "submit", request_id="r1") as op:
        op.outcome = "applied"
    with observe("job", "plan", job_key="r1:plan:1") as op:
        op.outcome = "succeeded"
    with observe("model_call", "ScriptedProvider"):
        pass
    with observe("tool_call", "github_comment") as op:
        op.outcome = "timeout"
    with observe("outbox_send", "slack") as op:
        op.outcome = "sent"
    with observe("http", "POST") as op:
        op.add(route="/v1/agents/{agent}/requests", status=201)
        op.outcome = "201"


def contract_problems(collector: Collector, expected: tuple[MetricName, ...] = ALL) -> list[str]:
    """What ``collector`` exports that the contract does not name, or names differently (type, labels, help); empty
    when it keeps to it. (The KPI helper's DomainCollector is checked with this against ``names.DOMAIN``.)"""
    by_family = {m.family: m for m in expected}
    problems = []
    for family in collector.collect():
        known = by_family.get(family.name)
        if known is None:
            problems.append(f"{family.name}: not in the contract")
            continue
        if family.type != known.type:
            problems.append(f"{family.name}: a {family.type}, the contract says {known.type}")
        if family.documentation != known.help:
            problems.append(f"{family.name}: help {family.documentation!r}, the contract says {known.help!r}")
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}
            if labels != set(known.labels):
                problems.append(f"{sample.name}: labels {sorted(labels)}, the contract says {sorted(known.labels)}")
            if sample.name not in known.samples() and not sample.name.endswith("_created"):
                problems.append(f"{sample.name}: not a series of {known.name}")
    return problems
