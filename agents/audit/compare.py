"""Comparing the journal with its shipped copy (`keel audit verify --against`): every manifest's seal and chain,
every segment's body, and every shipped event against the database's row of that id, the archived ones against
their archive records."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from psycopg.rows import dict_row

from agents.audit.segments import (
    MANIFEST_SUFFIX,
    Manifest,
    ManifestKeys,
    ShipError,
    manifest_name,
    manifest_problems,
    parse_manifest,
    parse_name,
    read_events,
    segment_name,
)
from agents.audit.store import SegmentStore
from agents.core.journal import ArchivedPart, archived_parts
from models.audit_records import recorded_shipments
from models.db import Database
from models.tables import GENESIS_HASH

#: Event fields whose difference means the event itself was changed (not only its link).
_LINK_FIELDS = frozenset({"prev_hash", "hash", "key_id"})


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
                rows = read_events(raw, manifest.after_id, manifest.last_id, None)  # every row of the range
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
