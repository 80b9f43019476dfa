"""Run-once jobs: the handler registry (``handlers``), the runner that claims a job, holds its lease and writes its
outcome through the core (``runner``), recurring schedules (``schedules``) and deadline enforcement (``deadlines``).
Imports ``agents.core`` and ``models`` only.
"""
