"""The operator console: Keel's agents, approvals, journal, outbox and KPIs in a browser, served by the API."""
