"""Side effects, only through the outbox: the relay that claims, reconciles, sends and confirms messages
(``relay``) and the Slack and GitHub senders it uses (``senders``). Imports ``agents.core`` and ``models`` only.
"""
