"""What the console's pages show, computed on the server: spend against budget, time left, SVG charts, the
inbox's filters and approval timeouts, and the arguments a person edits."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from agents.core.errors import InvalidInput
from agents.core.json_input import parse_json
from models.schemas import AgentState, WaitingApproval


@dataclass(frozen=True, slots=True)
class Spend:
    """Spend against budget: the text and the bar's fill (0-100; None when there is no budget)."""

    text: str
    percent: int | None
    over: bool


def spend(agent: AgentState) -> Spend:
    """The tighter of the token and cost budgets decides the bar."""
    parts: list[str] = []
    fractions: list[float] = []
    if agent.budget_tokens is not None:
        parts.append(f"{agent.spent_tokens:,} / {agent.budget_tokens:,} tokens")
        fractions.append(agent.spent_tokens / agent.budget_tokens if agent.budget_tokens else 1.0)
    else:
        parts.append(f"{agent.spent_tokens:,} tokens")
    if agent.budget_cost is not None:
        parts.append(f"${agent.spent_cost:.4f} / ${agent.budget_cost:.4f}")
        fractions.append(float(agent.spent_cost / agent.budget_cost) if agent.budget_cost else 1.0)
    elif agent.spent_cost > Decimal(0):
        parts.append(f"${agent.spent_cost:.4f}")
    if not fractions:
        return Spend(", ".join(parts), None, False)
    worst = max(fractions)
    return Spend(", ".join(parts), min(100, round(worst * 100)), worst >= 1.0)


def time_left(deadline: datetime | None, now: datetime) -> str:
    """``"4m 10s left"``, ``"passed 2m ago"``, or an empty string without a deadline."""
    if deadline is None:
        return ""
    left = deadline - now
    if left < timedelta(0):
        return f"passed {_span(-left)} ago"
    return f"{_span(left)} left"


def _span(span: timedelta) -> str:
    seconds = int(span.total_seconds())
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {seconds}s"
    return f"{seconds}s"


@dataclass(frozen=True, slots=True)
class Chart:
    """A bar chart drawn as SVG: one bar per minute, the peak labelled."""

    title: str
    width: int
    height: int
    bars: tuple[tuple[float, float, float, float, str], ...]  # x, y, width, height, tooltip
    peak: float
    start: str
    end: str


def chart(
    title: str, points: Sequence[tuple[datetime, float]], now: datetime, span: timedelta, *, width: int = 480
) -> Chart:
    """Per-minute values over the last ``span`` as bars on a time axis ending ``now``."""
    height = 120
    minutes = max(1, int(span.total_seconds() // 60))
    start = now - span
    bar = width / minutes
    shown = [(at, value) for at, value in points if start <= at <= now]
    peak = max((v for _, v in shown), default=0.0)
    bars = []
    for at, value in shown:
        offset = (at - start).total_seconds() / 60
        if peak <= 0:
            continue
        h = max(1.0, value / peak * (height - 10))
        bars.append(
            (
                round(offset * bar, 2),
                round(height - h, 2),
                round(max(1.0, bar - 1), 2),
                round(h, 2),
                f"{at:%H:%M} {value:g}",
            )
        )
    return Chart(title, width, height, tuple(bars), peak, f"{start:%H:%M}", f"{now:%H:%M}")


# --- the inbox ---------------------------------------------------------------------------------------------------

_AGE = re.compile(r"\s*(\d{1,9}(?:\.\d{1,6})?)\s*([smhd]?)\s*", re.IGNORECASE)
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
#: The longest minimum age a filter may ask for (as the API's ``min_age_seconds``).
MAX_AGE = timedelta(days=3650)


def parse_age(text: str | None) -> timedelta | None:
    """The inbox's minimum-age filter as typed: ``90`` or ``90s`` (seconds), ``15m``, ``2h``, ``1d``; blank: none.
    Anything else raises :class:`ValueError` naming the field and the rule."""
    if text is None or not text.strip():
        return None
    found = _AGE.fullmatch(text)
    if found is None:
        shown = text if len(text) <= 40 else text[:39] + "…"
        raise ValueError(
            f"min_age {shown!r} is not an age: give a number with s, m, h or d (seconds if none), e.g. 15m or 2h"
        )
    age = timedelta(seconds=float(found.group(1)) * _UNIT_SECONDS[found.group(2).lower()])
    if age > MAX_AGE:
        raise ValueError(f"min_age must be at most {MAX_AGE.days} days, got {found.group(0).strip()}")
    return age


def age(seconds: float) -> str:
    """How long something has waited, shortly: ``"4m 10s"``."""
    return _span(timedelta(seconds=max(0.0, seconds)))


@dataclass(frozen=True, slots=True)
class Timeout:
    """A waiting call's approval timeout as the inbox shows it; ``due``: it has passed, or the call was escalated."""

    text: str
    due: bool


def approval_timeout(call: WaitingApproval) -> Timeout | None:
    """What the call's approval timeout means now (on the database's clock, as read with the inbox); None: its tool
    has none."""
    if call.approval_timeout_seconds is None or call.times_out_at is None:
        return None
    limit = _span(timedelta(seconds=call.approval_timeout_seconds))
    if call.escalated:
        return Timeout(f"escalated after {limit}; still waiting for a person", True)
    now = call.since + timedelta(seconds=call.waited_seconds)
    left = call.times_out_at - now
    then = "escalated" if call.on_timeout == "escalate" else "rejected"
    if left > timedelta(0):
        return Timeout(f"{then} in {_span(left)} (limit {limit})", False)
    doing = "escalating" if call.on_timeout == "escalate" else "rejecting"
    return Timeout(f"limit {limit} passed {_span(-left)} ago: {doing} at the beat's next check", True)


# --- arguments -----------------------------------------------------------------------------------------------------


def pretty(value: Any) -> str:
    """JSON for a person to read or edit: indented, non-ASCII as it is."""
    return json.dumps(value, indent=2, ensure_ascii=False)


def compact(value: Any, limit: int = 80) -> str:
    """JSON on one line, cut at ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def text_rows(text: str, *, least: int = 4, most: int = 18) -> int:
    """How many rows a textarea needs to show ``text`` whole, within bounds."""
    return max(least, min(most, text.count("\n") + 2))


#: The longest arguments text the edit form takes.
MAX_ARGUMENTS_CHARS = 100_000


def edited_arguments(text: str) -> dict[str, Any]:
    """The arguments a person typed into the edit form: a JSON object, else :class:`ValueError` naming the field and
    the rule (where the JSON breaks, by line and column), as :func:`~agents.core.json_input.parse_json` has it."""
    if not text.strip():
        raise ValueError("arguments: give the call's arguments as a JSON object (the field is empty)")
    try:
        value = parse_json("arguments", text, limit=MAX_ARGUMENTS_CHARS)
    except InvalidInput as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(value, dict):
        kinds = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}
        kind = kinds.get(type(value), "a number")
        raise ValueError(f'arguments must be a JSON object ({{"name": value, …}}), got {kind}')
    return value


@dataclass(frozen=True, slots=True)
class Change:
    """One argument a person changed before approving: its name, the model's value and the person's (JSON)."""

    name: str
    before: str
    after: str


def argument_changes(details: Mapping[str, Any]) -> list[Change]:
    """The arguments an approval edited, from its journal event's details (``call.arguments``, the model's;
    ``edited_arguments``, the person's), by name; empty when it edited nothing."""
    call = details.get("call")
    edited = details.get("edited_arguments")
    if not isinstance(call, Mapping) or not isinstance(edited, Mapping):
        return []
    before = call.get("arguments")
    if not isinstance(before, Mapping):
        return []
    removed = "(not given)"
    return [
        Change(
            name,
            compact(before[name], 300) if name in before else removed,
            compact(edited[name], 300) if name in edited else removed,
        )
        for name in sorted(set(before) | set(edited))
        if (name in before) != (name in edited) or before.get(name) != edited.get(name)
    ]
