"""The daily KPI report: the last 24 hours' KPI table, posted to Slack through the outbox once a day from
``KEEL_KPI_REPORT_AT`` (UTC, on the database's clock), keyed by its date so no day is posted twice
(docs/explanation/runtime-outbox-and-workers.md#the-daily-kpi-report).
"""

from __future__ import annotations

from datetime import date, datetime, timedelta

from agents.core.keys import make_key
from agents.observability.kpis import report_lines
from models import alerts_sql, kpi_sql
from models.clock import database_now, rfc3339
from models.db import Database
from models.outbox_sql import NewMessage, insert_messages_txn
from models.settings import Settings

REPORT_REQUEST_ID = "kpi"
REPORT_WINDOW = timedelta(hours=24)


def report_key(day: date) -> str:
    """``kpi:daily-report:{YYYY-MM-DD}``: one key per UTC day."""
    return make_key(REPORT_REQUEST_ID, "daily-report", day.isoformat())


def due_day(now: datetime, at: str) -> date | None:
    """The UTC day whose report is due at ``now``: the day of the most recent ``at`` ("HH:MM") passed; None when
    "off"."""
    if at == "off":
        return None
    hours, minutes = (int(part) for part in at.split(":"))
    return (now - timedelta(hours=hours, minutes=minutes)).date()


def report_text(day: date, lines: list[tuple[str, str]], until: datetime) -> str:
    width = max((len(label) for label, _ in lines), default=0)
    table = "\n".join(f"{label:<{width}}  {value}" for label, value in lines)
    return f"Keel KPIs for {day.isoformat()} (the 24 h until {rfc3339(until)}):\n```\n{table}\n```"


def post_daily_report(db: Database, settings: Settings) -> str | None:
    """Insert today's report into the outbox if it is due and not in yet; returns its key if this call inserted it."""
    channel = settings.alert_slack_channel
    if channel is None:
        return None
    with db.transaction() as cur:
        now = database_now(cur)
    day = due_day(now, settings.kpi_report_at)
    if day is None:
        return None
    key = report_key(day)
    if alerts_sql.outbox_key_exists(db, key):  # the common case: posted already; spare the KPI query
        return None
    text = report_text(day, report_lines(kpi_sql.window(db, REPORT_WINDOW)), now)
    message = NewMessage(key, None, REPORT_REQUEST_ID, "slack", channel, {"text": text})
    with db.transaction() as cur:
        inserted, _ = insert_messages_txn(cur, [message])
    return key if inserted else None
