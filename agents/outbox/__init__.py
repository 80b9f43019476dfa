"""Side effects, only through the outbox: the relay that claims, reconciles, sends and confirms messages
(``relay``), the Slack and GitHub senders it uses (``senders``) and who Keel posts as at each (``identity``).
Imports ``agents.core`` and ``models`` only.
"""
