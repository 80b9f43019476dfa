"""The KPIs page: totals, the last hour, gauges, per-minute charts of the last hour and the open alerts, for a
token that sees every agent."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi import APIRouter
from starlette.responses import HTMLResponse

from agents.ingress.console import views
from agents.ingress.console.common import Keel, Who, page, refused
from agents.ingress.tokens import Permission
from models import alerts_sql, kpi_sql

router = APIRouter(include_in_schema=False)

#: The KPI charts' span and the counters they draw.
CHART_SPAN = timedelta(hours=1)
CHARTS = (
    ("requests_finished", "Requests finished per minute"),
    ("job_attempt_failures", "Failed attempts per minute"),
    ("suppressed_duplicates", "Suppressed duplicates per minute"),
    ("side_effect_confirmations", "Confirmed deliveries per minute"),
    ("spent_tokens", "Tokens spent per minute"),
)


@router.get("/kpis")
def kpis_page(keel: Keel, who: Who) -> HTMLResponse:
    if not who.can(Permission.READ_STORY) or who.token.agent_prefix is not None:
        return refused(who, f"Token {who.token.name!r} may not read the KPIs of every agent.")
    now = datetime.now(UTC)
    series = kpi_sql.per_minute(keel.db, [name for name, _ in CHARTS], CHART_SPAN)
    charts = [views.chart(title, series[name], now, CHART_SPAN) for name, title in CHARTS]
    return page(
        "kpis.html",
        who,
        totals=kpi_sql.totals(keel.db),
        hour=kpi_sql.window(keel.db, timedelta(hours=1)),
        gauges=kpi_sql.gauges(keel.db),
        charts=charts,
        alerts=alerts_sql.open_episodes(keel.db),
    )
