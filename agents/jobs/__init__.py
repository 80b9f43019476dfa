"""Run-once jobs: the handler registry (``handlers``), the runner that claims a job and writes its outcome through
the core (``runner``) with the threads that renew leases (``leases``) and run handlers (``handler_threads``),
recurring schedules (``schedules``) and deadline enforcement (``deadlines``). Imports ``agents.core`` and ``models``
only."""
