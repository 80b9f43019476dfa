"""The agent runtime: inference providers (``inference``), the tools a model may call (``tools``), the
plan/tool/gate loop registered as job handlers (``loop``), and the notices and timeouts of calls that wait for
approval (``notices``, ``approvals``). Imports ``agents.core``, ``agents.jobs``, ``agents.outbox`` and ``models``.
"""
