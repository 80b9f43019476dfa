"""Shipping the journal to a separate store as sealed segments (`keel audit ship`, and the leading beat).

A **segment** is JSON Lines: the journal's events in global id order, every column as stored (``details`` as the
exact text that was hashed). It closes at ``KEEL_AUDIT_SEGMENT_EVENTS`` events or once its oldest event is
``KEEL_AUDIT_SEGMENT_MINUTES`` old (database clock). Each segment has a **manifest**: the id range it covers (after
the previous segment's last id, up to its own), its event count, the sha256 of its body, each agent chain's head
within it, and the sha256 of the previous manifest, so the manifests form a chain of their own and a segment taken
away breaks it. The manifest is keyed with an HMAC under the journal's audit key ring (its key id recorded) and,
when ``KEEL_AUDIT_SIGNING_KEY`` is set, also signed with Ed25519: the HMAC needs the same secret that checks the
journal, which an operator running `keel audit verify` has anyway; the signature lets someone holding only the
public key (an outside auditor) check the shipped copy, and cannot be made by whoever merely checks it.

**Which ids are safe to ship.** Ids come from one sequence when a row is inserted, but transactions commit in any
order: id 100 may commit after id 101. A segment that took 101 while 100 was still in flight would skip 100 for
ever. The rule: read the highest committed id ``M``, then wait until every transaction that held the journal's
insert lock (``RowExclusiveLock`` in ``pg_locks``) at that moment has ended. A transaction that took an id below
``M`` took the lock before taking the id (an INSERT locks its table before evaluating its values) and held it until
it ended, so once those transactions are gone every id up to ``M`` is committed or will never be: what is read up
to ``M`` afterwards is final. As a second guard, each agent's events in a new segment must follow its events
already shipped (event ``s - 1`` is at or below the previous segment's last id); otherwise nothing is shipped and
the error names the chain.

**Crashes.** Object names are deterministic (``journal/{first_id:020d}-{last_id:020d}.jsonl`` and
``.manifest.json``); the body is written before the manifest, and a segment counts as shipped once its manifest is
in the store. A shipper resuming finds the last manifest in the store (the store is the authority; the database's
``audit_shipments`` only says where to start looking), and a body left without its manifest is completed: its
events are read again and must be byte for byte what is there. Nothing is rewritten: an object already there with
other content is an error naming it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, cast

import psycopg
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from psycopg.rows import dict_row

from agents.audit.store import SegmentStore, open_store
from agents.core.journal import ArchivedPart, archived_parts, canonical_json
from models.audit_destination import StoreUrl, load_signing_key, parse_store_url
from models.audit_keys import audit_keys_for
from models.audit_records import recorded_shipments, shipment_seal_parts
from models.clock import rfc3339
from models.db import Database
from models.errors import KeelError
from models.settings import Settings
from models.tables import GENESIS_HASH

#: The manifest's format tag; also the first part of its HMAC, so no other use of the key ring can be replayed here.
MANIFEST_FORMAT = "keel-journal-segment-v1"
SEGMENT_SUFFIX = ".jsonl"
MANIFEST_SUFFIX = ".manifest.json"
_NAME = re.compile(r"^journal/(\d{20})-(\d{20})(\.jsonl|\.manifest\.json)$")
#: Event fields whose difference means the event itself was changed (not only its link).
_LINK_FIELDS = frozenset({"prev_hash", "hash", "key_id"})


class ManifestKeys(Protocol):
    """The journal's audit key ring, as the manifests use it (models/audit_keys.py)."""

    @property
    def current(self) -> str: ...

    def __contains__(self, key_id: object) -> bool: ...

    def mac(self, key_id: str, parts: Sequence[str | int | None]) -> str: ...

    def verifies(self, key_id: str, parts: Sequence[str | int | None], digest: str) -> bool: ...


class ShipError(KeelError):
    """The journal could not be shipped."""


class ShipperBusy(ShipError):
    """Another shipper is shipping to this destination right now."""


def segment_name(first_id: int, last_id: int) -> str:
    return f"journal/{first_id:020d}-{last_id:020d}{SEGMENT_SUFFIX}"


def manifest_name(first_id: int, last_id: int) -> str:
    return f"journal/{first_id:020d}-{last_id:020d}{MANIFEST_SUFFIX}"


def parse_name(name: str) -> tuple[int, int, str] | None:
    """(first id, last id, suffix) of a segment's or manifest's object name; None for any other name."""
    found = _NAME.fullmatch(name)
    return None if found is None else (int(found.group(1)), int(found.group(2)), found.group(3))


# --- events as shipped --------------------------------------------------------------------------------------------


def event_line(row: dict[str, Any]) -> dict[str, Any]:
    """One journal row as a segment holds it: every column, ``details`` as its stored text, times in Keel's one
    format (microseconds, UTC), ids as text. A column added to the journal later is shipped too."""
    line: dict[str, Any] = {}
    for name, value in row.items():
        if name == "details":
            continue
        if name == "details_json":
            line["details"] = value
        elif isinstance(value, datetime):
            line[name] = rfc3339(value)
        elif isinstance(value, int | str) or value is None:
            line[name] = value
        else:
            line[name] = str(value)
    return line


_EVENTS = (
    "SELECT j.*, j.details::text AS details_json FROM audit.journal j WHERE j.id > %s AND j.id <= %s"
    " ORDER BY j.id LIMIT %s"
)


def _read_events(conn: psycopg.Connection[Any], after_id: int, upto_id: int, limit: int | None) -> list[dict[str, Any]]:
    """The events with ids in (after_id, upto_id], at most ``limit`` (None: all), as segments hold them."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_EVENTS, (after_id, upto_id, limit))
        return [event_line(row) for row in cur.fetchall()]


def body_of(lines: Sequence[dict[str, Any]]) -> bytes:
    return "".join(canonical_json(line) + "\n" for line in lines).encode()


# --- manifests ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Manifest:
    """A parsed manifest and the sha256 of its object (what the next manifest links to)."""

    name: str
    data: dict[str, Any]
    sha256: str

    @property
    def first_id(self) -> int:
        return int(self.data["first_id"])

    @property
    def last_id(self) -> int:
        return int(self.data["last_id"])

    @property
    def after_id(self) -> int:
        return int(self.data["after_id"])

    @property
    def segment(self) -> str:
        return str(self.data["segment"])


def _sealed_bytes(data: dict[str, Any]) -> bytes:
    return canonical_json({k: v for k, v in data.items() if k not in ("hmac", "signature")}).encode()


def _mac_parts(data: dict[str, Any]) -> list[str | int | None]:
    return [MANIFEST_FORMAT, hashlib.sha256(_sealed_bytes(data)).hexdigest()]


def make_manifest(
    lines: Sequence[dict[str, Any]],
    body: bytes,
    *,
    after_id: int,
    previous: Manifest | None,
    keys: ManifestKeys,
    signing_key: Ed25519PrivateKey | None,
) -> tuple[str, bytes]:
    """The manifest of the segment ``lines`` (serialized as ``body``): its object name and bytes. Deterministic:
    the same events, previous manifest and keys make the same bytes (a retried write finds them identical)."""
    first, last = int(lines[0]["id"]), int(lines[-1]["id"])
    chains: dict[str, dict[str, Any]] = {}
    for line in lines:
        chain = chains.setdefault(str(line["agent_id"]), {"first_seq": line["seq"], "events": 0})
        chain.update(last_seq=line["seq"], head=line["hash"])
        chain["events"] += 1
    data: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "segment": segment_name(first, last),
        "after_id": after_id,
        "first_id": first,
        "last_id": last,
        "events": len(lines),
        "first_at": lines[0]["at"],
        "last_at": lines[-1]["at"],
        "bytes": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "chains": chains,
        "previous": None if previous is None else {"manifest": previous.name, "sha256": previous.sha256},
        "key_id": keys.current,
    }
    data["hmac"] = keys.mac(keys.current, _mac_parts(data))
    if signing_key is not None:
        public = signing_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        data["signature"] = {
            "alg": "ed25519",
            "public_key": base64.b64encode(public).decode(),
            "value": base64.b64encode(signing_key.sign(_sealed_bytes(data))).decode(),
        }
    return manifest_name(first, last), (canonical_json(data) + "\n").encode()


def parse_manifest(name: str, raw: bytes) -> Manifest:
    """The manifest in ``raw``, or :class:`ShipError` naming what is wrong with its shape."""
    try:
        data = json.loads(raw)
    except ValueError:
        raise ShipError(f"manifest {name} is not JSON") from None
    needed = {"format", "segment", "after_id", "first_id", "last_id", "events", "sha256", "chains", "key_id", "hmac"}
    if not isinstance(data, dict) or not needed <= data.keys() or data["format"] != MANIFEST_FORMAT:
        raise ShipError(f"manifest {name} is not a {MANIFEST_FORMAT} manifest")
    return Manifest(name, data, hashlib.sha256(raw).hexdigest())


def manifest_problems(
    manifest: Manifest, keys: ManifestKeys | None, public_key: Ed25519PublicKey | None = None
) -> list[str]:
    """What is wrong with the manifest's seal: its HMAC under the key ring (when the ring holds its key) and its
    Ed25519 signature (when ``public_key`` is given). A manifest that neither check vouches for is a problem too."""
    data, problems, vouched = manifest.data, [], False
    key_id = str(data["key_id"])
    if keys is not None and key_id in keys:
        if keys.verifies(key_id, _mac_parts(data), str(data["hmac"])):
            vouched = True
        else:
            problems.append(f"manifest {manifest.name}: its HMAC (key {key_id}) does not match its content")
    if public_key is not None:
        signature = data.get("signature")
        if not isinstance(signature, dict):
            problems.append(f"manifest {manifest.name} is not signed")
        else:
            try:
                public_key.verify(base64.b64decode(str(signature.get("value", ""))), _sealed_bytes(data))
                vouched = True
            except (InvalidSignature, ValueError):
                problems.append(f"manifest {manifest.name}: its Ed25519 signature does not verify with the public key")
    if not vouched and not problems:
        problems.append(
            f"manifest {manifest.name} is keyed with audit key {key_id!r}, which is not in the key ring"
            " (KEEL_AUDIT_KEYS): nothing vouches for it (give --public-key to check its signature)"
        )
    return problems


# --- the database's side ------------------------------------------------------------------------------------------


def _lock_key(destination: str) -> str:
    return "keel-audit-ship:" + destination


@contextmanager
def _shipper_lock(db: Database, destination: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection holding the destination's shipper lock (one shipper per destination), in autocommit. A session
    of its own on the direct URL: behind a transaction pooler the lock would be taken on one server connection and
    released on another (leaked for good), and :func:`settled_id` tells its own backend from the others' by pid."""
    with db.session(autocommit=True, prepare_threshold=None) as conn:
        row = conn.execute("SELECT has_table_privilege('audit_shipments', 'INSERT')").fetchone()
        if not (row and row[0]):
            raise ShipError(
                "this database role may not record shipments (the auditor role reads only): ship as the"
                " application role"
            )
        row = conn.execute(
            "SELECT pg_try_advisory_lock(hashtextextended(%s, 13))", (_lock_key(destination),)
        ).fetchone()
        if not (row and row[0]):
            raise ShipperBusy(f"another shipper is shipping the journal to {destination} right now")
        try:
            yield conn
        finally:
            conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 13))", (_lock_key(destination),))


_IN_FLIGHT = (
    "SELECT coalesce(array_agg(DISTINCT virtualtransaction), '{}') FROM pg_locks"
    " WHERE locktype = 'relation' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND relation = 'audit.journal'::regclass AND mode = 'RowExclusiveLock'"
    # A prepared transaction's locks have no pid: IS DISTINCT FROM keeps them (<> would drop a NULL).
    " AND pid IS DISTINCT FROM pg_backend_pid()"
)
_STILL_IN_FLIGHT = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'relation' AND relation = 'audit.journal'::regclass"
    " AND mode = 'RowExclusiveLock' AND virtualtransaction = ANY(%s)"
)


def settled_id(conn: psycopg.Connection[Any], *, timeout: timedelta) -> int | None:
    """The highest journal id below which every id is final (committed, or never to be): see the module's
    docstring. None when a transaction writing the journal is still open after ``timeout``."""
    row = conn.execute("SELECT coalesce(max(id), 0) FROM audit.journal").fetchone()
    highest = int(row[0]) if row else 0
    row = conn.execute(_IN_FLIGHT).fetchone()
    in_flight = list(row[0]) if row else []
    give_up = time.monotonic() + timeout.total_seconds()
    while in_flight:
        row = conn.execute(_STILL_IN_FLIGHT, (in_flight,)).fetchone()
        if not row or not row[0]:
            break
        if time.monotonic() > give_up:
            return None
        time.sleep(0.05)
    return highest


def _unfollowed(conn: psycopg.Connection[Any], lines: Sequence[dict[str, Any]], after_id: int) -> str | None:
    """The first agent chain whose events in ``lines`` do not follow its events shipped before (at or below
    ``after_id``), described; None when every chain follows on."""
    firsts: dict[str, int] = {}
    for line in lines:
        firsts.setdefault(str(line["agent_id"]), int(line["seq"]))
    later = {agent: seq for agent, seq in firsts.items() if seq > 1}
    if not later:
        return None
    with conn.cursor() as cur:
        cur.execute(
            "SELECT x.agent_id::text FROM unnest(%s::uuid[], %s::bigint[]) AS x(agent_id, seq)"
            " WHERE EXISTS (SELECT 1 FROM audit.journal j WHERE j.agent_id = x.agent_id AND j.seq = x.seq - 1"
            " AND j.id <= %s)"
            # An archived event was shipped (keel audit archive proved it) and is no longer in the journal.
            " OR EXISTS (SELECT 1 FROM audit.archived_partitions a"
            " WHERE (a.heads -> x.agent_id::text ->> 'last_seq')::bigint >= x.seq - 1)",
            (list(later), list(later.values()), after_id),
        )
        found = {str(r[0]) for r in cur.fetchall()}
    for agent, seq in later.items():
        if agent not in found:
            return f"agent {agent}'s event {seq} would be shipped, but its event {seq - 1} is not among those shipped"
    return None


def _record(conn: psycopg.Connection[Any], destination: str, manifest: Manifest, keys: ManifestKeys) -> None:
    """Note the segment of ``manifest`` as shipped, sealed under the current audit key (models/audit_records.py)."""
    parts = shipment_seal_parts(
        destination=destination,
        first_id=manifest.first_id,
        last_id=manifest.last_id,
        events=int(manifest.data["events"]),
        segment=manifest.segment,
        manifest_sha256=manifest.sha256,
    )
    conn.execute(
        "INSERT INTO audit_shipments (destination, first_id, last_id, events, segment, manifest_sha256, key_id, seal)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
        (*parts[1:], keys.current, keys.mac(keys.current, parts)),
    )


def recorded_last_id(db: Database, destination: str) -> int | None:
    """The last journal id the database records (in a row whose seal holds) as shipped to ``destination``."""
    with db.connection() as conn:
        try:
            return recorded_shipments(conn, destination, db.audit_keys).last_id
        finally:
            conn.rollback()


# --- shipping -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShippedSegment:
    segment: str
    manifest: str
    first_id: int
    last_id: int
    events: int
    resumed: bool  # its body was already in the store (a shipper stopped between body and manifest)


@dataclass(frozen=True, slots=True)
class ShipReport:
    destination: str
    segments: tuple[ShippedSegment, ...]
    last_id: int  # the last id shipped, after this run
    waiting: int  # committed events not in a closed segment yet
    unsettled: bool = False  # a transaction writing the journal stayed open: shipping waits for it
    notes: tuple[str, ...] = ()  # what the shipper passed over (audit_shipments rows whose seal does not hold)


@dataclass(slots=True)
class _Tail:
    manifest: Manifest | None
    orphan: tuple[int, int] | None  # (first id, last id) of a body written without its manifest
    found_after_record: list[Manifest] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def last_id(self) -> int:
        return 0 if self.manifest is None else self.manifest.last_id


def _find_tail(conn: psycopg.Connection[Any], store: SegmentStore, destination: str, keys: ManifestKeys) -> _Tail:
    notes = recorded_shipments(conn, destination, keys)
    recorded = notes.segment
    manifest: Manifest | None = None
    start_after = ""
    if recorded is not None:
        parsed = parse_name(recorded)
        if parsed is None:
            raise ShipError(f"audit_shipments records {recorded!r}, which is not a segment's name")
        name = manifest_name(parsed[0], parsed[1])
        raw = store.get(name)
        if raw is None:
            raise ShipError(
                f"the database records segment {recorded} as shipped to {destination}, but the store has no {name}:"
                " the store lost objects, or is not the one shipped to (see docs/runbook.md, 'Journal shipping')"
            )
        manifest, start_after = parse_manifest(name, raw), name
    bodies: dict[tuple[int, int], str] = {}
    manifests: list[str] = []
    for name in store.names(start_after):
        parsed = parse_name(name)
        if parsed is None:
            continue
        if parsed[2] == MANIFEST_SUFFIX:
            manifests.append(name)
        else:
            bodies[parsed[0], parsed[1]] = name
    later: list[Manifest] = []
    for name in manifests:
        raw = store.get(name)
        if raw is None:
            raise ShipError(f"{name} was listed but cannot be read")
        later.append(parse_manifest(name, raw))
    if later:
        manifest = later[-1]
    if manifest is not None:
        problems = manifest_problems(manifest, keys)
        if problems:
            raise ShipError(f"the store's last segment does not hold: {problems[0]}; shipping stops (see the runbook)")
    after = 0 if manifest is None else manifest.last_id
    orphans = sorted(r for r in bodies if r[0] > after)
    if len(orphans) > 1:
        raise ShipError(
            f"the store holds several segment bodies without manifests past id {after}:"
            f" {', '.join(segment_name(*r) for r in orphans)}; a shipper writes one at a time"
        )
    return _Tail(
        manifest,
        orphans[0] if orphans else None,
        later,
        [f"{text}: passed over" for text in (*notes.forged, *notes.unchecked)],
    )


def ship(
    db: Database,
    store: SegmentStore,
    keys: ManifestKeys,
    *,
    destination: str,
    segment_events: int,
    segment_age: timedelta,
    signing_key: Ed25519PrivateKey | None = None,
    flush: bool = False,
    max_segments: int | None = None,
    settle_timeout: timedelta = timedelta(seconds=30),
    after_body: Any = None,
) -> ShipReport:
    """Ship every closed segment past the store's last one (with ``flush``: also the events of a segment not closed
    yet), each as body then manifest; record each in ``audit_shipments`` once the store holds it. ``after_body``
    (tests) is called between a segment's body and its manifest."""
    shipped: list[ShippedSegment] = []
    with _shipper_lock(db, destination) as conn:
        tail = _find_tail(conn, store, destination, keys)
        notes = tuple(tail.notes)
        for found in tail.found_after_record:  # the store got further than the database heard
            _record(conn, destination, found, keys)
        previous, orphan = tail.manifest, tail.orphan
        while max_segments is None or len(shipped) < max_segments:
            after_id = 0 if previous is None else previous.last_id
            settled = settled_id(conn, timeout=settle_timeout)
            if settled is None:
                return ShipReport(destination, tuple(shipped), after_id, 0, unsettled=True, notes=notes)
            if orphan is not None:
                if orphan[1] > settled:
                    raise ShipError(
                        f"{segment_name(*orphan)} in the store reaches past the journal's last id {settled}"
                    )
                lines = _read_events(conn, after_id, orphan[1], orphan[1] - after_id)
            else:
                lines = _read_events(conn, after_id, settled, segment_events)
                if not lines:
                    return ShipReport(destination, tuple(shipped), after_id, 0, notes=notes)
                row = conn.execute("SELECT clock_timestamp()").fetchone()
                assert row is not None
                oldest_at = datetime.fromisoformat(str(lines[0]["at"]).replace("Z", "+00:00"))
                closed = len(lines) >= segment_events or flush or oldest_at <= row[0] - segment_age
                if not closed:
                    waiting = conn.execute(
                        "SELECT count(*) FROM audit.journal WHERE id > %s AND id <= %s", (after_id, settled)
                    ).fetchone()
                    return ShipReport(
                        destination, tuple(shipped), after_id, int(waiting[0]) if waiting else 0, notes=notes
                    )
            if not lines:
                raise ShipError(f"{segment_name(*orphan) if orphan else 'a segment'} covers no journal events")
            problem = _unfollowed(conn, lines, after_id)
            if problem is not None:
                raise ShipError(f"not shipping ids {lines[0]['id']}..{lines[-1]['id']}: {problem}")
            body = body_of(lines)
            name = segment_name(int(lines[0]["id"]), int(lines[-1]["id"]))
            if orphan is not None and (int(lines[0]["id"]), int(lines[-1]["id"])) != orphan:
                raise ShipError(f"{segment_name(*orphan)} in the store does not match the journal's ids there")
            body_written = store.put_new(name, body)
            if after_body is not None:
                after_body(name)
            mname, mbytes = make_manifest(
                lines, body, after_id=after_id, previous=previous, keys=keys, signing_key=signing_key
            )
            store.put_new(mname, mbytes)
            previous = parse_manifest(mname, mbytes)
            _record(conn, destination, previous, keys)
            shipped.append(
                ShippedSegment(
                    name, mname, previous.first_id, previous.last_id, len(lines), resumed=body_written == "present"
                )
            )
            orphan = None
        return ShipReport(destination, tuple(shipped), 0 if previous is None else previous.last_id, 0, notes=notes)


# --- comparing the database with the store ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Divergence:
    """One difference between the database and the shipped copy, or a fault of the shipped copy itself."""

    # changed, removed, inserted, reforged, missing_segment, bad_manifest, bad_segment, archive, store,
    # forged_record
    kind: str
    text: str


@dataclass(frozen=True, slots=True)
class AgainstReport:
    destination: str
    segments: int
    events: int  # events compared
    last_id: int  # the last id shipped
    unshipped: int  # events in the database past it
    divergences: tuple[Divergence, ...]
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.divergences


def _describe(line: dict[str, Any]) -> str:
    return f"journal id {line['id']} (agent {line['agent_id']} event {line['seq']})"


@dataclass(slots=True)
class _Reforged:
    first: dict[str, Any]
    count: int = 0
    last_seq: int = 0


@dataclass(frozen=True, slots=True)
class SegmentRead:
    """One segment as read from the store and checked against its manifest: the manifest (None: unreadable), the
    body's events (None: the body is missing or does not match the manifest's sha256 and bytes), what is wrong."""

    manifest: Manifest | None
    lines: list[dict[str, Any]] | None
    problems: list[Divergence]


def read_segment(
    store: SegmentStore,
    name: str,
    named: tuple[int, int],
    previous: Manifest | None,
    keys: ManifestKeys | None,
    public_key: Ed25519PublicKey | None = None,
) -> SegmentRead:
    """Read manifest ``name`` (whose object name says ids ``named``) and its segment, and check them: the manifest's
    seal (HMAC and/or signature), that it follows ``previous`` (its ``after_id`` and ``previous`` link; None: it must
    be the first), the body's sha256, bytes and event count."""
    found: list[Divergence] = []
    data = store.get(name)
    if data is None:
        return SegmentRead(None, None, [Divergence("store", f"{name} was listed but cannot be read")])
    try:
        manifest = parse_manifest(name, data)
    except ShipError as exc:
        return SegmentRead(None, None, [Divergence("bad_manifest", str(exc))])
    found += [Divergence("bad_manifest", p) for p in manifest_problems(manifest, keys, public_key)]
    if (manifest.first_id, manifest.last_id) != named:
        found.append(
            Divergence(
                "bad_manifest",
                f"manifest {name} describes ids {manifest.first_id}..{manifest.last_id}, not those its name says",
            )
        )
    expected_after = 0 if previous is None else previous.last_id
    link = manifest.data.get("previous")
    if (
        manifest.after_id != expected_after
        or (previous is not None and (not isinstance(link, dict) or link.get("sha256") != previous.sha256))
        or (previous is None and link is not None)
    ):
        missing_from = expected_after + 1
        found.append(
            Divergence(
                "missing_segment",
                f"segment missing: {name} follows id {manifest.after_id}"
                f" ({'manifest ' + str(link.get('manifest')) if isinstance(link, dict) else 'no manifest'})"
                f" but the store's previous segment ends at id {expected_after}: ids {missing_from}.."
                f"{manifest.after_id} are not in the store",
            )
        )
    body = store.get(manifest.segment)
    if body is None:
        found.append(
            Divergence(
                "missing_segment", f"segment missing: {manifest.segment} (its manifest is there, its body is not)"
            )
        )
        return SegmentRead(manifest, None, found)
    if hashlib.sha256(body).hexdigest() != manifest.data["sha256"] or (
        "bytes" in manifest.data and len(body) != manifest.data["bytes"]
    ):
        found.append(
            Divergence(
                "bad_segment",
                f"segment {manifest.segment} does not match the sha256 and size its manifest seals: the shipped copy"
                " was changed in the store",
            )
        )
        return SegmentRead(manifest, None, found)
    lines = [json.loads(text) for text in body.decode().splitlines()]
    if len(lines) != manifest.data["events"]:
        found.append(
            Divergence(
                "bad_segment",
                f"segment {manifest.segment} holds {len(lines)} events, its manifest says {manifest.data['events']}",
            )
        )
    return SegmentRead(manifest, lines, found)


def differing_fields(shipped: dict[str, Any], line: dict[str, Any]) -> list[str]:
    """The fields in which a shipped event and the database's row of that id (as :func:`event_line`) differ."""
    return sorted(k for k in shipped.keys() | line.keys() if shipped.get(k) != line.get(k))


def verify_against(
    db: Database,
    store: SegmentStore,
    keys: ManifestKeys | None,
    *,
    destination: str,
    public_key: Ed25519PublicKey | None = None,
    segment_events: int | None = None,
    segment_age: timedelta | None = None,
) -> AgainstReport:
    """Compare the journal with the shipped copy in ``store``: every manifest's seal and chain, every segment's
    body against its manifest, and every shipped event against the database's row of that id; name each event
    changed, removed or inserted after shipping, each chain whose links were recomputed, each segment missing.
    The store's manifests are walked to its end, whatever ``audit_shipments`` says. A store holding no segment
    while the journal holds a closed segment's worth of events (``segment_events``, or an event older than
    ``segment_age``; without them: any event) is a divergence too: there is nothing to compare them with."""
    found: list[Divergence] = []
    notes: list[str] = []
    bodies: dict[tuple[int, int], str] = {}
    manifests: list[tuple[int, int, str]] = []
    for name in store.names():
        parsed = parse_name(name)
        if parsed is None:
            notes.append(f"{name} is not a segment or manifest name; left alone")
        elif parsed[2] == MANIFEST_SUFFIX:
            manifests.append((parsed[0], parsed[1], name))
        else:
            bodies[parsed[0], parsed[1]] = name
    manifests.sort()
    heads: dict[str, tuple[int, str]] = {}  # the shipped copy's own chains: agent -> (last seq, its hash)
    reforged: dict[str, _Reforged] = {}
    previous: Manifest | None = None
    compared = 0
    last_id = 0
    seen: dict[str, str] = {}  # manifest name -> its sha256, as the store holds it
    with db.connection() as raw:
        raw.rollback()
        raw.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        raw.read_only = True
        try:
            archive = _ArchiveTally(archived_parts(raw))
            for first, last, name in manifests:
                segment = read_segment(store, name, (first, last), previous, keys, public_key)
                found += segment.problems
                if segment.manifest is None:
                    continue
                manifest = previous = segment.manifest
                seen[manifest.name] = manifest.sha256
                last_id = max(last_id, manifest.last_id)
                if segment.lines is None:
                    continue
                lines = segment.lines
                for line in lines:
                    agent = str(line["agent_id"])
                    seq, prev_hash = heads.get(agent, (0, GENESIS_HASH))
                    if line["seq"] != seq + 1 or line["prev_hash"] != prev_hash:
                        found.append(
                            Divergence(
                                "bad_segment",
                                f"segment {manifest.segment}: {_describe(line)} does"
                                " not follow the previous shipped event of its chain",
                            )
                        )
                    heads[agent] = (int(line["seq"]), str(line["hash"]))
                rows = _read_events(raw, manifest.after_id, manifest.last_id, None)  # every row of the range
                compared += _compare(manifest.segment, lines, rows, found, reforged, archive)
            with raw.cursor(row_factory=dict_row) as cur:
                cur.execute(
                    "SELECT count(*) AS events, min(id) AS first_id, max(id) AS last_id, min(at) AS oldest,"
                    " clock_timestamp() AS now FROM audit.journal WHERE id > %s",
                    (last_id,),
                )
                past = cur.fetchone()
                assert past is not None
                unshipped = int(past["events"])
                first_end = None
                if not manifests and unshipped:
                    cur.execute(
                        "SELECT id FROM audit.journal ORDER BY id OFFSET %s LIMIT 1", ((segment_events or 1) - 1,)
                    )
                    end = cur.fetchone()
                    first_end = int(end["id"]) if end else int(past["last_id"])
            recorded = recorded_shipments(raw, destination, keys, every=True)
        finally:
            raw.rollback()
            raw.isolation_level = None
            raw.read_only = None
    found += archive.problems(seen)
    for agent, r in reforged.items():
        found.append(
            Divergence(
                "reforged",
                f"agent {agent}'s chain was re-forged: {r.count} event(s) from event {r.first['seq']} (journal id"
                f" {r.first['id']}) to event {r.last_seq} carry other hashes than the shipped copy",
            )
        )
    if first_end is not None:
        shippable = (
            segment_events is None
            or unshipped >= segment_events
            or (segment_age is not None and past["oldest"] <= past["now"] - segment_age)
        )
        if shippable:
            found.append(
                Divergence(
                    "missing_segment",
                    f"the store at {destination} holds no segments, but the journal holds {unshipped} events (ids"
                    f" {past['first_id']}..{past['last_id']}) that should have been shipped:"
                    f" {segment_name(int(past['first_id']), first_end)} onwards are missing (nothing was shipped"
                    " there, or the store lost everything: is it the right URL?)",
                )
            )
        else:
            notes.append(
                f"the store at {destination} holds no segments yet: the journal's {unshipped} events wait for their"
                " first segment to close (KEEL_AUDIT_SEGMENT_EVENTS or KEEL_AUDIT_SEGMENT_MINUTES)"
            )
    found += [Divergence("forged_record", text) for text in recorded.forged]
    if recorded.unchecked:
        notes.append(
            f"{len(recorded.unchecked)} audit_shipments rows are sealed with an audit key the ring does not hold:"
            f" not checked, not used (the first: {recorded.unchecked[0]})"
        )
    if recorded.last_id is not None and recorded.last_id > last_id:
        unchecked = " (its seal not checked: no audit key ring)" if keys is None else ""
        found.append(
            Divergence(
                "missing_segment",
                f"segment missing: the database records {recorded.segment} (to id {recorded.last_id}) as shipped"
                f"{unchecked}, but the store's segments end at id {last_id}",
            )
        )
    for (first, last), name in sorted(bodies.items()):
        if (first, last, manifest_name(first, last)) in manifests:
            continue
        if first > last_id:
            notes.append(f"{name} has no manifest yet: a shipper stopped mid-segment; the next ship completes it")
        else:
            found.append(Divergence("bad_segment", f"{name} has no manifest and lies inside the shipped range"))
    return AgainstReport(destination, len(manifests), compared, last_id, unshipped, tuple(found), tuple(notes))


class _ArchiveTally:
    """The archive records (audit.archived_partitions) checked against the store while it is walked: a shipped event
    missing from the database inside an archived id range was archived, not removed; each record's event count,
    heads and manifests must be what the store holds."""

    def __init__(self, parts: list[ArchivedPart]) -> None:
        self.parts = [p for p in parts if p.first_id is not None and p.last_id is not None]
        self.empty = [p for p in parts if p.first_id is None]
        self.counted = {p.partition: 0 for p in self.parts}
        self.heads = {
            (agent, int(head["last_seq"])): (p.partition, str(head["hash"]))
            for p in self.parts
            for agent, head in p.heads.items()
        }
        self.matched: set[tuple[str, int]] = set()
        self.wrong: list[Divergence] = []

    def holds(self, line: dict[str, Any]) -> bool:
        """Whether ``line`` (shipped, not in the database) lies in an archived range: counted against that record."""
        jid = int(line["id"])
        # The month decides, by the event's time, not its id: two transactions on either side of a month's end can
        # take their ids in the other order, so ids of neighbouring months may interleave there.
        at = datetime.fromisoformat(str(line["at"]).replace("Z", "+00:00"))
        for part in self.parts:
            if (
                part.first_id is not None
                and part.last_id is not None
                and part.first_id <= jid <= part.last_id
                and (part.from_at is None or part.from_at <= at)
                and at < part.to_at
            ):
                self.counted[part.partition] += 1
                key = (str(line["agent_id"]), int(line["seq"]))
                if key in self.heads:
                    partition, digest = self.heads[key]
                    if digest == line["hash"]:
                        self.matched.add(key)
                    else:
                        self.wrong.append(
                            Divergence(
                                "archive",
                                f"archive record {partition} puts agent {key[0]}'s archived head at event {key[1]}"
                                f" with another hash than the store's {_describe(line)}",
                            )
                        )
                        self.matched.add(key)
                return True
        return False

    def problems(self, seen: dict[str, str]) -> list[Divergence]:
        found = list(self.wrong)
        for part in self.parts:
            for entry in part.manifests:
                name, digest = str(entry.get("manifest")), entry.get("sha256")
                if seen.get(name) != digest:
                    there = "is not in the store" if name not in seen else "is in the store with another sha256"
                    found.append(
                        Divergence(
                            "archive", f"archive record {part.partition} was covered by manifest {name}, which {there}"
                        )
                    )
            if self.counted[part.partition] != part.events:
                found.append(
                    Divergence(
                        "archive",
                        f"archive record {part.partition} says {part.events} events (ids {part.first_id}.."
                        f"{part.last_id}) left the database, but the store holds {self.counted[part.partition]} shipped"
                        " events of that range that the database lacks",
                    )
                )
        for (agent, seq), (partition, _) in self.heads.items():
            if (agent, seq) not in self.matched:
                found.append(
                    Divergence(
                        "archive",
                        f"archive record {partition} puts agent {agent}'s archived head at event {seq}, which no"
                        " shipped event of its range is",
                    )
                )
        return found


def _compare(
    segment: str,
    shipped: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    found: list[Divergence],
    reforged: dict[str, _Reforged],
    archive: _ArchiveTally,
) -> int:
    """Merge the shipped events of one segment with the database's rows of its id range, by id."""
    in_db = {int(r["id"]): r for r in rows}
    in_store = {int(line["id"]): line for line in shipped}
    for jid in sorted(in_store.keys() | in_db.keys()):
        line, row = in_store.get(jid), in_db.get(jid)
        if row is None:
            assert line is not None
            if archive.holds(line):
                continue
            found.append(
                Divergence(
                    "removed", f"{_describe(line)} was removed from the database after it was shipped ({segment})"
                )
            )
            continue
        if line is None:
            found.append(
                Divergence(
                    "inserted",
                    f"{_describe(row)} was inserted into the database after ids up to"
                    f" it were shipped ({segment} does not hold it)",
                )
            )
            continue
        differ = differing_fields(line, row)
        if not differ:
            continue
        content = [k for k in differ if k not in _LINK_FIELDS]
        if content:
            found.append(
                Divergence(
                    "changed",
                    f"{_describe(line)} was changed after it was shipped ({segment}): {', '.join(content)} differ",
                )
            )
        relinked = [k for k in differ if k in _LINK_FIELDS and k != "hash"]
        if relinked and "hash" not in differ:  # a changed hash is reported with its whole chain, as re-forged
            found.append(
                Divergence(
                    "changed",
                    f"{_describe(line)} was re-linked after it was shipped ({segment}): {', '.join(relinked)} differ",
                )
            )
        if "hash" in differ:
            agent = str(line["agent_id"])
            r = reforged.setdefault(agent, _Reforged(line))
            r.count += 1
            r.last_seq = int(line["seq"])
    return len(shipped)


# --- configured -----------------------------------------------------------------------------------------------------


def _db_time_plus(db: Database) -> Callable[[int], datetime]:
    def retain_until(days: int) -> datetime:
        with db.connection() as conn:
            row = conn.execute("SELECT clock_timestamp() + make_interval(days => %s)", (days,)).fetchone()
            conn.rollback()
        assert row is not None
        return cast(datetime, row[0])

    return retain_until


def destination_of(settings: Settings, url: str | None = None) -> StoreUrl:
    """The store ``url`` names, else ``KEEL_AUDIT_SHIP_URL``; :class:`ShipError` when neither is set or the URL is
    not a store's."""
    text = url if url is not None else settings.audit_ship_url
    if text is None:
        raise ShipError("no store to ship to: set KEEL_AUDIT_SHIP_URL (s3://bucket/prefix or file:///path)")
    try:
        return parse_store_url(text)
    except ValueError as exc:
        raise ShipError(str(exc)) from None


def open_configured_store(db: Database, settings: Settings, destination: StoreUrl) -> SegmentStore:
    """The store at ``destination``, with the settings' S3 endpoint and Object Lock retention (counted from the
    database's clock)."""
    return open_store(
        destination,
        endpoint_url=settings.audit_s3_endpoint_url,
        lock_days=settings.audit_object_lock_days,
        lock_mode=settings.audit_object_lock_mode,
        retain_until=_db_time_plus(db),
    )


def ship_configured(
    db: Database, settings: Settings, *, url: str | None = None, flush: bool = False, after_body: Any = None
) -> ShipReport:
    """:func:`ship` with the settings' store, segment size and age, audit key ring and signing key."""
    destination = destination_of(settings, url)
    signing = settings.audit_signing_key
    return ship(
        db,
        open_configured_store(db, settings, destination),
        audit_keys_for(settings),
        destination=str(destination),
        segment_events=settings.audit_segment_events,
        segment_age=timedelta(minutes=settings.audit_segment_minutes),
        signing_key=None if signing is None else load_signing_key(signing.get_secret_value()),
        flush=flush,
        settle_timeout=timedelta(seconds=settings.audit_settle_seconds),
        after_body=after_body,
    )
