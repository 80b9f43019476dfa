"""Reserved for observability: Prometheus metrics, structured logging and alerts. Empty until its issue lands; it
may import ``agents.core`` and ``models``.
"""
