"""Adapters that run a framework's agent as Keel steps: :mod:`agents.integrations.pydantic_ai`
(``keel[pydantic-ai]``)."""
