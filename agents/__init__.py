"""Keel's agent control plane, a folder per concern: ``core`` imports only ``models``; ``jobs`` and ``outbox`` build on
it, ``runtime`` on those, ``client`` and ``cli`` sit on top, and nothing in the product imports ``demo``
(docs/explanation/architecture.md#code-layout; tests/unit/test_layout.py enforces it)."""
