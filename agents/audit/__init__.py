"""Reserved for the audit trail beyond ``keel audit verify``: shipping sealed, signed journal segments to a separate
store, archiving and export. Empty until its issue lands; it may import ``agents.core`` and ``models``.
"""
