"""What is shipped: the journal's events as a segment holds them (JSON Lines, every column as stored), the
object names of segments and manifests, and the manifest that seals each segment and links it to the one before.
Explained in docs/explanation/ingress-and-audit.md#shipped-segments-and-their-manifests."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import psycopg
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from psycopg.rows import dict_row

from agents.core.journal import canonical_json
from models.clock import rfc3339
from models.errors import KeelError

#: The manifest's format tag; also the first part of its HMAC, so no other use of the key ring can be replayed here.
MANIFEST_FORMAT = "keel-journal-segment-v1"
SEGMENT_SUFFIX = ".jsonl"
MANIFEST_SUFFIX = ".manifest.json"
_NAME = re.compile(r"^journal/(\d{20})-(\d{20})(\.jsonl|\.manifest\.json)$")


class ManifestKeys(Protocol):
    """The journal's audit key ring, as the manifests use it (models/audit_keys.py)."""

    @property
    def current(self) -> str: ...

    def __contains__(self, key_id: object) -> bool: ...

    def mac(self, key_id: str, parts: Sequence[str | int | None]) -> str: ...

    def verifies(self, key_id: str, parts: Sequence[str | int | None], digest: str) -> bool: ...


class ShipError(KeelError):
    """The journal could not be shipped."""


def segment_name(first_id: int, last_id: int) -> str:
    return f"journal/{first_id:020d}-{last_id:020d}{SEGMENT_SUFFIX}"


def manifest_name(first_id: int, last_id: int) -> str:
    return f"journal/{first_id:020d}-{last_id:020d}{MANIFEST_SUFFIX}"


def parse_name(name: str) -> tuple[int, int, str] | None:
    """(first id, last id, suffix) of a segment's or manifest's object name; None for any other name."""
    found = _NAME.fullmatch(name)
    return None if found is None else (int(found.group(1)), int(found.group(2)), found.group(3))


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


def read_events(conn: psycopg.Connection[Any], after_id: int, upto_id: int, limit: int | None) -> list[dict[str, Any]]:
    """The events with ids in (after_id, upto_id], at most ``limit`` (None: all), as segments hold them."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_EVENTS, (after_id, upto_id, limit))
        return [event_line(row) for row in cur.fetchall()]


def body_of(lines: Sequence[dict[str, Any]]) -> bytes:
    return "".join(canonical_json(line) + "\n" for line in lines).encode()


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
