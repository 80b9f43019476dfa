"""Reserved for the HTTP ingress: the FastAPI API, tokens and scopes, per-token rate limits, live events (SSE) and
the console. Empty until its issue lands; it may import ``agents.client``, ``agents.core`` and ``models``.
"""
