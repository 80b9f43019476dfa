"""Observability: Prometheus metrics (``metrics``, ``names``, ``kpis``, ``scrape``), structured logging (``logs``),
traces (``tracing``, ``otlp``), alerts and the daily KPI report (``alerts``, ``report``). Imports ``agents.core`` and
``models`` only.
"""
