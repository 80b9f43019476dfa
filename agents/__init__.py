"""Keel's agent control plane, a folder per concern.

``core`` (phases, commands, the single ``transition()``, journal, keys, policies, errors) imports only ``models``;
``jobs`` (handlers, runner, schedules, deadlines) and ``outbox`` (relay, senders) build on it; ``runtime`` (inference,
tools, the plan/tool/gate loop) on those; ``client`` and ``cli`` sit on top. ``demo`` is the demo and its fake
servers: nothing in the product imports it. tests/unit/test_layout.py enforces the rules.
"""
