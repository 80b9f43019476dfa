"""The audit trail beyond the journal itself: ``keel audit verify`` with its outcome recorded (``verify``) and one
request's story for an auditor (``export``). It may import ``agents.core`` and ``models``.
"""
