"""The agent runtime: inference providers (``inference``), the tools a model may call (``tools``) and the
plan/tool/gate loop registered as job handlers (``loop``). Imports ``agents.core``, ``agents.jobs``,
``agents.outbox`` and ``models``.
"""
