"""TEMPORARY (alerts branch): a stand-in for the KPI helper's ``report_lines(k)`` (/work/notes/contract.md), so the
daily KPI report can be built and tested here. The lead replaces this file with the KPI helper's at merge."""

from __future__ import annotations

from models.kpi_sql import Kpis


def report_lines(k: Kpis) -> list[tuple[str, str]]:
    """TEMPORARY: (label, formatted value) rows of the KPI table."""

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value * 100:.1f}%"

    return [
        ("side-effect confirmations", f"{k.confirmations:,.0f}"),
        ("side-effect duplicates", f"{k.side_effect_duplicates:,.0f}"),
        ("requests done / failed", f"{k.requests_done:,.0f} / {k.requests_failed:,.0f}"),
        ("recovery rate after a first failure", rate(k.recovery_rate)),
        ("retry-caused cost share", rate(k.retry_cost_share)),
    ]
