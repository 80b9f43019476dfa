"""The immutable journal: each agent's events form a chain keyed with an audit key kept outside the database
(``chain``), appended in the transaction that changes the agent (``write``), read back (``reads``, ``page``), and
checked by `keel audit verify` (``walk``, ``verification``, ``verdict``); archived months are ``archived``. Why it is
built this way: docs/explanation/journal-and-transitions.md."""

from __future__ import annotations

from agents.core.journal.archived import (
    ArchivedPart,
    archive_seal_parts,
    archive_seal_problem,
    archived_heads,
    archived_parts,
)
from agents.core.journal.chain import (
    HASHED,
    canonical_json,
    event_hash,
    event_mac,
    link_problem,
    mac_parts,
    signing_keys,
)
from agents.core.journal.page import JournalPage, journal_page
from agents.core.journal.reads import (
    FOLLOW_BATCH,
    agent_events_after,
    events,
    events_after,
    events_at_revision,
    journal_heads,
    latest_events,
    request_scope,
    snapshot,
)
from agents.core.journal.verification import (
    VERIFY_CHUNK_CHAINS,
    VERIFY_CHUNK_EVENTS,
    LegacyPart,
    VerifyReport,
    verify,
    verify_chain,
)
from agents.core.journal.walk import (
    ChainBreak,
    ChainCheck,
    ChainHead,
    ChainPosition,
    ChainWalk,
    LegacySeal,
    Unchecked,
    check_chain,
    legacy_seals,
)
from agents.core.journal.write import append_side_event_txn, new_event

__all__ = [
    "FOLLOW_BATCH",
    "HASHED",
    "VERIFY_CHUNK_CHAINS",
    "VERIFY_CHUNK_EVENTS",
    "ArchivedPart",
    "ChainBreak",
    "ChainCheck",
    "ChainHead",
    "ChainPosition",
    "ChainWalk",
    "JournalPage",
    "LegacyPart",
    "LegacySeal",
    "Unchecked",
    "VerifyReport",
    "agent_events_after",
    "append_side_event_txn",
    "archive_seal_parts",
    "archive_seal_problem",
    "archived_heads",
    "archived_parts",
    "canonical_json",
    "check_chain",
    "event_hash",
    "event_mac",
    "events",
    "events_after",
    "events_at_revision",
    "journal_heads",
    "journal_page",
    "latest_events",
    "legacy_seals",
    "link_problem",
    "mac_parts",
    "new_event",
    "request_scope",
    "signing_keys",
    "snapshot",
    "verify",
    "verify_chain",
]
