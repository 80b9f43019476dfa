"""Shipping the journal to a separate store as sealed segments (`keel audit ship`, and the leading beat): one shipper
per destination, each segment's body then its manifest, resumed from the store's last manifest after a crash.
Explained in docs/explanation/ingress-and-audit.md#shipping-the-journal-and-crashes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

import psycopg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agents.audit.segments import (
    MANIFEST_SUFFIX,
    Manifest,
    ManifestKeys,
    ShipError,
    body_of,
    make_manifest,
    manifest_name,
    manifest_problems,
    parse_manifest,
    parse_name,
    read_events,
    segment_name,
)
from agents.audit.settle import settled_id, unfollowed
from agents.audit.store import SegmentStore, open_store
from models.audit_destination import StoreUrl, load_signing_key, parse_store_url
from models.audit_keys import audit_keys_for
from models.audit_records import recorded_shipments, shipment_seal_parts
from models.db import Database
from models.settings import Settings


class ShipperBusy(ShipError):
    """Another shipper is shipping to this destination right now."""


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
                lines = read_events(conn, after_id, orphan[1], orphan[1] - after_id)
            else:
                lines = read_events(conn, after_id, settled, segment_events)
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
            problem = unfollowed(conn, lines, after_id)
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
