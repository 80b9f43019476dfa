"""`keel audit archive`: the only way journal rows leave the database (docs/audit-retention.md). A month of the journal
leaves only once every event in it is proved, against the store, to be shipped and verified (four checks:
:func:`check_archivable`); :func:`archive_partition` then records the sealed archive row and drops the month in one
transaction, and every refusal (:class:`ArchiveRefused`) changes nothing. The checks, one by one:
docs/explanation/ingress-and-audit.md#archiving-a-month."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from agents.audit.compare import differing_fields, read_segment
from agents.audit.segments import MANIFEST_SUFFIX, Manifest, ShipError, event_line, parse_manifest, parse_name
from agents.audit.store import SegmentStore
from agents.core.errors import quoted
from agents.core.journal import (
    ChainWalk,
    archive_seal_parts,
    archived_heads,
    archived_parts,
    legacy_seals,
)
from models.audit_keys import AuditKeys
from models.clock import rfc3339
from models.errors import KeelError
from models.keepalives import tcp_options
from models.urls import libpq_url

#: How often the final transaction tries to take the journal's lock (each try waits at most LOCK_TIMEOUT).
LOCK_TRIES = 10
LOCK_TIMEOUT = "2s"


class ArchiveRefused(KeelError):
    """The partition was not archived: nothing was changed."""


@dataclass(frozen=True, slots=True)
class Archivable:
    """What :func:`check_archivable` proved of an id range: the manifests that cover it (object name and sha256 of
    each) and, per agent with events in it, the head its chain reaches there (:meth:`ChainPosition.as_head`)."""

    first_id: int | None
    last_id: int | None
    events: int
    manifests: list[dict[str, Any]]
    heads: dict[str, dict[str, Any]]


def _names(conn: psycopg.Connection[Any], agent_ids: Sequence[str]) -> dict[str, str]:
    rows = conn.execute(
        "SELECT id::text, name FROM agents WHERE id = ANY(%s::uuid[])"
        " UNION ALL SELECT agent_id::text, name || ' (deleted)' FROM audit.deleted_agents"
        " WHERE agent_id = ANY(%s::uuid[])",
        (list(agent_ids), list(agent_ids)),
    ).fetchall()
    return {str(r[0]): str(r[1]) for r in rows}


def _ids(ids: Sequence[int]) -> str:
    return f"id {ids[0]}" if len(ids) == 1 else f"ids {ids[0]}..{ids[-1]}"


def check_archivable(
    conn: psycopg.Connection[Any],
    store: SegmentStore,
    keys: AuditKeys,
    *,
    what: str,
    destination: str,
    first_id: int | None,
    last_id: int | None,
    events: int,
    relation: tuple[str, str] = ("audit", "journal"),
    public_key: Ed25519PublicKey | None = None,
) -> Archivable:
    """Prove that the ``events`` events of ``relation`` with ids in [``first_id``, ``last_id``] are shipped and
    verified (the four checks of docs/explanation/ingress-and-audit.md#archiving-a-month), in the caller's
    transaction (which should hold a lock that keeps them as they are); :class:`ArchiveRefused` naming the first thing
    missing or different. ``what`` names the range in those messages (``partition journal_2027_01``). Reads only."""
    if events == 0 or first_id is None or last_id is None:
        return Archivable(None, None, 0, [], {})
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            sql.SQL(
                "SELECT j.*, j.details::text AS details_json FROM {} j WHERE j.id BETWEEN %s AND %s ORDER BY j.id"
            ).format(sql.Identifier(*relation)),
            (first_id, last_id),
        )
        rows = cur.fetchall()
    if len(rows) != events:
        raise ArchiveRefused(f"{what}: {events} events were expected in ids {first_id}..{last_id}, found {len(rows)}")
    names = _names(conn, sorted({str(r["agent_id"]) for r in rows}))

    def agent(agent_id: object) -> str:
        name = names.get(str(agent_id))
        return f"agent {quoted(name)}" if name is not None else f"agent {agent_id}"

    # 1. The manifests covering the range, each checked, each linked to the one before it.
    listed = sorted(
        (parsed[0], parsed[1], name)
        for name in store.names()
        if (parsed := parse_name(name)) is not None and parsed[2] == MANIFEST_SUFFIX
    )
    covering = [i for i, (first, last, _) in enumerate(listed) if last >= first_id and first <= last_id]
    previous: Manifest | None = None
    if covering and covering[0] > 0:
        _, _, before = listed[covering[0] - 1]
        raw_before = store.get(before)
        if raw_before is None:
            raise ArchiveRefused(f"{what}: manifest {before} in {destination} cannot be read")
        try:
            previous = parse_manifest(before, raw_before)
        except ShipError as exc:
            raise ArchiveRefused(f"{what}: {exc}") from None
    shipped: dict[int, tuple[dict[str, Any], Manifest]] = {}
    manifests: list[Manifest] = []
    for index in covering:
        first, last, name = listed[index]
        segment = read_segment(store, name, (first, last), previous, keys, public_key)
        if segment.problems:
            raise ArchiveRefused(f"{what}: " + "; ".join(p.text for p in segment.problems))
        assert segment.manifest is not None and segment.lines is not None
        previous = segment.manifest
        manifests.append(segment.manifest)
        for line in segment.lines:
            if first_id <= int(line["id"]) <= last_id:
                shipped[int(line["id"])] = (line, segment.manifest)
    # 2. Every event shipped, byte for byte.
    missing = [int(r["id"]) for r in rows if int(r["id"]) not in shipped]
    if missing:
        raise ArchiveRefused(
            f"{what}: {len(missing)} events ({_ids(missing)}) are not in any shipped segment of {destination}; run"
            " 'keel audit ship'"
        )
    for row in rows:
        line, manifest = shipped[int(row["id"])]
        differ = differing_fields(line, event_line(row))
        if differ:
            raise ArchiveRefused(
                f"{what}: event {row['seq']} of {agent(row['agent_id'])} (id {row['id']}) differs from the shipped"
                f" copy in segment {manifest.segment}: {', '.join(differ)}"
            )
    # 3. Every chain with events here verifies over them, from the previous archive's head (or genesis).
    problems, starts = archived_heads(archived_parts(conn), keys)
    if problems:
        raise ArchiveRefused(f"{what}: the archive records already there do not verify: {'; '.join(problems)}")
    by_agent: dict[UUID, list[dict[str, Any]]] = {}
    for row in rows:
        by_agent.setdefault(row["agent_id"], []).append(row)
    seals = legacy_seals(conn, list(by_agent))
    heads: dict[str, dict[str, Any]] = {}
    for agent_id, chain in by_agent.items():
        start = starts.get(agent_id)
        walk = ChainWalk(agent_id, keys, seals.get(agent_id), None if start is None else start[0])
        broken = walk.check_seal()
        for row in chain:
            if broken is not None:
                break
            broken = walk.step(row)
        if broken is not None:
            where = f"journal id {broken.journal_id}" if broken.journal_id is not None else "its head"
            raise ArchiveRefused(
                f"{what}: the chain of {agent(agent_id)} does not verify over its events here: event {broken.seq}"
                f" ({where}): {broken.reason}"
            )
        for part in walk.unchecked_parts():
            raise ArchiveRefused(
                f"{what}: {part.events} events of {agent(agent_id)} (from event {part.seq}) are linked with audit key"
                f" {part.key_id!r}, which the key ring (KEEL_AUDIT_KEYS) does not hold: they cannot be checked"
            )
        heads[str(agent_id)] = walk.position.as_head()
    # 4. The store agrees on where each chain's part here ends.
    for agent_key, head in heads.items():
        last_seq = int(head["last_seq"])
        last_row = by_agent[UUID(agent_key)][-1]
        _, holder = shipped[int(last_row["id"])]
        chain = holder.data["chains"].get(agent_key)
        if not isinstance(chain, dict):
            raise ArchiveRefused(
                f"{what}: manifest {holder.name} does not list {agent(agent_key)}, whose event it holds"
            )
        agrees = (
            int(chain["last_seq"]) >= last_seq
            if holder.last_id > last_id  # the segment runs past the range: later events of the chain may be in it
            else int(chain["last_seq"]) == last_seq and chain.get("head") == head["hash"]
        )
        if not agrees:
            raise ArchiveRefused(
                f"{what}: manifest {holder.name} puts the head of {agent(agent_key)} at event {chain['last_seq']}, but"
                f" its last event here is event {last_seq}"
            )
    return Archivable(
        first_id,
        last_id,
        events,
        [{"manifest": m.name, "sha256": m.sha256} for m in manifests],
        heads,
    )


# --- the record ---------------------------------------------------------------------------------------------------


def sealed_record(
    keys: AuditKeys,
    proved: Archivable,
    *,
    partition: str,
    from_at: datetime | None,
    to_at: datetime,
    archived_by: str,
    archived_at: datetime,
) -> dict[str, Any]:
    """The ``audit.archived_partitions`` row for what :func:`check_archivable` proved, sealed under the ring's
    current key."""
    record: dict[str, Any] = {
        "partition": partition,
        "from_at": from_at,
        "to_at": to_at,
        "first_id": proved.first_id,
        "last_id": proved.last_id,
        "events": proved.events,
        "manifests": proved.manifests,
        "heads": proved.heads,
        "archived_by": archived_by,
        "archived_at": archived_at,
    }
    seal = keys.mac(keys.current, archive_seal_parts(key_id=keys.current, **record))
    return {**record, "key_id": keys.current, "seal": seal}


def insert_record_txn(conn: psycopg.Connection[Any], record: dict[str, Any]) -> None:
    """Insert the sealed archive record in the caller's transaction (the owner's: the application may not)."""
    values = {**record, "manifests": Jsonb(record["manifests"]), "heads": Jsonb(record["heads"])}
    conn.execute(
        "INSERT INTO audit.archived_partitions (partition, from_at, to_at, first_id, last_id, events, manifests,"
        " heads, archived_by, archived_at, key_id, seal) VALUES (%(partition)s, %(from_at)s, %(to_at)s,"
        " %(first_id)s, %(last_id)s, %(events)s, %(manifests)s, %(heads)s, %(archived_by)s, %(archived_at)s,"
        " %(key_id)s, %(seal)s)",
        values,
    )


# --- partitions ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Partition:
    """An attached partition of ``audit.journal`` and its bounds (``from_at`` None: from MINVALUE)."""

    schema: str
    name: str
    from_at: datetime | None
    to_at: datetime


# Every partition attached to the journal, with its bound as PostgreSQL prints it:
# FOR VALUES FROM (MINVALUE) TO ('2027-02-01 00:00:00+00').
_PARTITIONS = """
SELECT n.nspname AS schema, c.relname AS name, pg_get_expr(c.relpartbound, c.oid) AS bound
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE i.inhparent = 'audit.journal'::regclass
"""
_BOUND = re.compile(r"^FOR VALUES FROM \((.+)\) TO \((.+)\)$")


def attached_partitions(conn: psycopg.Connection[Any]) -> list[Partition]:
    """The journal's attached partitions, oldest month first."""
    found: list[Partition] = []
    for row in conn.execute(_PARTITIONS).fetchall():
        schema, name, bound = str(row[0]), str(row[1]), str(row[2])
        match = _BOUND.fullmatch(bound)
        if match is None:
            raise ArchiveRefused(f"partition {name} of audit.journal has a bound archive does not know: {bound}")
        lower, upper = (
            None if text == "MINVALUE" else conn.execute("SELECT %s::timestamptz", (text.strip("'"),)).fetchone()
            for text in match.groups()
        )
        if upper is None:
            raise ArchiveRefused(f"partition {name} of audit.journal has no upper bound: it cannot be archived")
        found.append(Partition(schema, name, None if lower is None else lower[0], upper[0]))
    return sorted(found, key=lambda p: p.to_at)


def choose_partition(
    partitions: Sequence[Partition], requested: str | None, *, now: datetime, grace: timedelta
) -> Partition:
    """The partition to archive: the oldest attached one (months leave in order), only once its month ended more than
    ``grace`` before ``now``; ``requested`` must be it. :class:`ArchiveRefused` otherwise."""
    if not partitions:
        raise ArchiveRefused("audit.journal has no partitions attached: there is no month to archive")
    oldest = partitions[0]
    if requested is not None and requested not in (oldest.name, f"{oldest.schema}.{oldest.name}"):
        names = {p.name for p in partitions} | {f"{p.schema}.{p.name}" for p in partitions}
        if requested not in names:
            raise ArchiveRefused(
                f"audit.journal has no partition {quoted(requested)}"
                f" (attached: {', '.join(p.name for p in partitions)})"
            )
        raise ArchiveRefused(
            f"partition {requested} is not the oldest attached ({oldest.name} is): months leave in order, so the"
            " archived part of every chain stays a prefix"
        )
    if oldest.to_at > now:
        raise ArchiveRefused(
            f"partition {oldest.name}: its month is not over (it ends at {rfc3339(oldest.to_at)}); it can be archived"
            f" {grace.days} days after that (KEEL_AUDIT_ARCHIVE_GRACE_DAYS)"
        )
    if oldest.to_at + grace > now:
        raise ArchiveRefused(
            f"partition {oldest.name}: its month ended at {rfc3339(oldest.to_at)}, less than {grace.days} days ago"
            " (KEEL_AUDIT_ARCHIVE_GRACE_DAYS): not archived yet"
        )
    return oldest


@dataclass(frozen=True, slots=True)
class ArchiveReport:
    partition: str
    first_id: int | None
    last_id: int | None
    events: int
    manifests: int
    agents: int
    dry_run: bool


_WHO = """
SELECT session_user AS login, current_user AS role, r.rolsuper AS superuser, c.relkind AS kind,
       pg_get_userbyid(c.relowner) AS owner, pg_has_role(current_user, c.relowner, 'USAGE') AS may_own
FROM pg_class c, pg_roles r
WHERE c.oid = to_regclass('audit.journal') AND r.rolname = current_user
"""


def archive_partition(
    url: str,
    store: SegmentStore,
    keys: AuditKeys,
    *,
    destination: str,
    grace: timedelta,
    partition: str | None = None,
    dry_run: bool = False,
    public_key: Ed25519PublicKey | None = None,
) -> ArchiveReport:
    """Archive the journal's oldest partition through the database at ``url`` (the owner's credentials): choose it
    (:func:`choose_partition`), lock it (SHARE: nothing changes it while it is checked), prove it shipped and
    verified (:func:`check_archivable`), then in the same transaction insert the sealed record and detach and drop
    the partition, under a lock timeout of 2 s, retried. ``dry_run``: the checks only."""
    with psycopg.connect(libpq_url(url), **tcp_options(url)) as conn:
        who = conn.execute(_WHO).fetchone()
        if who is None:
            raise ArchiveRefused("this database has no audit.journal: run 'keel db upgrade'")
        login, role, superuser, kind, owner, may_own = who
        if not (superuser or may_own):
            raise ArchiveRefused(
                f"database role {quoted(role)} cannot detach partitions of audit.journal: only its owner ({owner}) or"
                " a superuser may; run keel audit archive with the owner's credentials (KEEL_MIGRATION_DATABASE_URL)"
            )
        if kind != "p":
            raise ArchiveRefused(
                "audit.journal is not partitioned (migration 0017_journal_partitions has not run): there is no month"
                " to archive"
            )
        row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        chosen = choose_partition(attached_partitions(conn), partition, now=row[0], grace=grace)
        table = sql.Identifier(chosen.schema, chosen.name)
        conn.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(table))
        stats = conn.execute(sql.SQL("SELECT min(id), max(id), count(*) FROM {}").format(table)).fetchone()
        assert stats is not None
        first_id, last_id, events = stats[0], stats[1], int(stats[2])
        what = f"partition {chosen.name}"
        proved = check_archivable(
            conn,
            store,
            keys,
            what=what,
            destination=destination,
            first_id=first_id,
            last_id=last_id,
            events=events,
            relation=(chosen.schema, chosen.name),
            public_key=public_key,
        )
        report = ArchiveReport(
            chosen.name, first_id, last_id, events, len(proved.manifests), len(proved.heads), dry_run
        )
        if dry_run:
            conn.rollback()
            return report
        row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        record = sealed_record(
            keys,
            proved,
            partition=chosen.name,
            from_at=chosen.from_at,
            to_at=chosen.to_at,
            archived_by=str(login),
            archived_at=row[0],
        )
        for attempt in range(LOCK_TRIES):
            try:
                with conn.transaction():  # a savepoint: a lock timeout undoes this try only, the checks stand
                    conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                    insert_record_txn(conn, record)
                    conn.execute(sql.SQL("ALTER TABLE audit.journal DETACH PARTITION {}").format(table))
                    conn.execute(sql.SQL("DROP TABLE {}").format(table))
                break
            except psycopg.errors.LockNotAvailable:
                time.sleep(min(0.5 * (attempt + 1), 3.0))
        else:
            conn.rollback()
            raise ArchiveRefused(
                f"{what}: could not take audit.journal's lock within {LOCK_TIMEOUT} in {LOCK_TRIES} tries (a long"
                " reader holds it: a keel audit verify, a report); nothing was changed, try again"
            )
        conn.commit()
        return report
