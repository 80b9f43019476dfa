"""The API's routers, one per resource: ``health`` (liveness, readiness, problem types), ``agents`` (agents, their
decisions, journal and live events), ``requests`` (submits and each request's story), ``records`` (jobs, outbox)."""
