"""The journal's key ring (``KEEL_AUDIT_KEYS``, ``KEEL_AUDIT_KEY_ID``): the secrets every journal event's link is an
HMAC under, kept outside the database; outside production, a key generated once under ``KEEL_HOME``. A secret never
leaves :class:`AuditKeys` (not in its repr, not in an error text) except through :func:`audit_key_secrets`, to the log
redaction. How keys rotate: docs/explanation/storage-and-jobs.md#the-journals-key-ring."""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from models.errors import KeelError
from models.settings import AUDIT_KEY_ID, MIN_AUDIT_SECRET_BYTES, Settings

#: The generated development key, below ``KEEL_HOME``.
DEV_KEY_FILE = "audit-key.json"


class AuditKeyMissing(KeelError):
    """no audit key: Keel links journal events only with a key kept outside the database. Set KEEL_AUDIT_KEYS (key
    id -> secret, as JSON) and KEEL_AUDIT_KEY_ID"""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or " ".join((self.__doc__ or "").split()))


@dataclass(frozen=True, slots=True)
class AuditKeys:
    """A key ring: the secrets by key id, and ``current``, the id new journal events are linked with."""

    current: str
    secrets: Mapping[str, bytes] = field(repr=False)

    def __post_init__(self) -> None:
        if self.current not in self.secrets:
            raise AuditKeyMissing(f"the key ring has no key {self.current!r} (its keys: {', '.join(self.ids)})")

    def __repr__(self) -> str:
        return f"AuditKeys(current={self.current!r}, ids={self.ids!r})"

    @classmethod
    def of(cls, ring: Mapping[str, str], current: str) -> AuditKeys:
        """A ring from secrets as text (their UTF-8 bytes are the keys)."""
        return cls(current, {key_id: secret.encode() for key_id, secret in ring.items()})

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(sorted(self.secrets))

    def __contains__(self, key_id: object) -> bool:
        return key_id in self.secrets

    def mac(self, key_id: str, parts: Sequence[str | int | None]) -> str:
        """HMAC-SHA256, in hex, under key ``key_id``, of ``parts`` written as one compact JSON array: an unambiguous
        encoding (no two lists of parts share a text). Each use starts its parts with a tag of its own."""
        message = json.dumps(list(parts), separators=(",", ":")).encode()
        return hmac.digest(self.secrets[key_id], message, "sha256").hex()

    def verifies(self, key_id: str, parts: Sequence[str | int | None], digest: str) -> bool:
        """Whether ``digest`` is :meth:`mac` of ``parts`` under ``key_id`` (compared in constant time, as bytes: a
        tampered digest with characters that are not ASCII is a mismatch, not a TypeError)."""
        return hmac.compare_digest(self.mac(key_id, parts).encode(), digest.encode("utf-8", "surrogatepass"))


def legacy_seal_parts(agent_id: str, seq: int, head: str) -> list[str | int | None]:
    """What the upgrade to keyed links (migration 0015) sealed for a chain with events from before it: the chain's
    length and head then. The seal is :meth:`AuditKeys.mac` of these parts."""
    return ["keel-legacy-chain-v1", agent_id, seq, head]


def audit_keys_for(settings: Settings) -> AuditKeys:
    """The key ring ``settings`` configure, or (never in production) the development key under ``KEEL_HOME``,
    generated on first use."""
    current = settings.current_audit_key_id
    if current is not None:
        return AuditKeys.of({k: v.get_secret_value() for k, v in settings.audit_keys.items()}, current)
    if settings.environment == "production":  # the settings refuse this already; say it again rather than generate
        raise AuditKeyMissing()
    return development_key(settings.home)


def development_key(home: Path) -> AuditKeys:
    """The key generated once under ``home`` (``audit-key.json``, readable by its owner only), made now if there is
    none. Processes starting together agree: the file appears whole or not at all, and the first one wins."""
    path = home / DEV_KEY_FILE
    if not path.exists():
        try:
            _generate(home, path)
        except OSError as exc:
            raise AuditKeyMissing(
                f"cannot write the development audit key {path} ({exc.strerror}): set KEEL_AUDIT_KEYS and"
                " KEEL_AUDIT_KEY_ID, or KEEL_HOME to a folder this process can write"
            ) from None
    key_id, secret = _read_key_file(path)
    return AuditKeys.of({key_id: secret}, key_id)


def _generate(home: Path, path: Path) -> None:
    home.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"key_id": f"dev-{secrets.token_hex(4)}", "secret": secrets.token_urlsafe(48)})
    draft = home / f".{DEV_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it first: use theirs
            os.link(draft, path)
    finally:
        draft.unlink(missing_ok=True)


def _read_key_file(path: Path) -> tuple[str, str]:
    try:
        data = json.loads(path.read_text())
        key_id, secret = data["key_id"], data["secret"]
    except (OSError, ValueError, TypeError, KeyError):
        raise AuditKeyMissing(
            f"{path} is not the audit key Keel generated (JSON with key_id and secret): restore it from a backup,"
            " or set KEEL_AUDIT_KEYS and KEEL_AUDIT_KEY_ID"
        ) from None
    if not (isinstance(key_id, str) and AUDIT_KEY_ID.fullmatch(key_id)) or not isinstance(secret, str):
        raise AuditKeyMissing(f"{path}: key_id and secret must be text (key_id: letters, digits and . _ -)")
    if len(secret.encode()) < MIN_AUDIT_SECRET_BYTES:
        raise AuditKeyMissing(f"{path}: its secret must be at least {MIN_AUDIT_SECRET_BYTES} bytes")
    return key_id, secret


def audit_key_secrets(settings: Settings) -> list[str]:
    """Every audit secret a process on ``settings`` links or checks events with, for the log redaction: the
    configured ring's, or the development key's once it exists (reading never generates one: a process that opens
    the database afterwards registers again)."""
    if settings.audit_keys:
        return [secret.get_secret_value() for secret in settings.audit_keys.values()]
    path = settings.home / DEV_KEY_FILE
    if settings.environment == "production" or not path.exists():
        return []
    try:
        return [_read_key_file(path)[1]]
    except AuditKeyMissing:  # reported by the process's first journal write
        return []
