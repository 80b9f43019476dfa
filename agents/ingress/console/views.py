"""What the console's pages show, computed on the server: spend against budget, time left, SVG charts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from models.schemas import AgentState


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
