"""The settings of the journal's guards: its key ring, `keel audit verify`, shipping, partitions and archives. A
part of :class:`models.settings.Settings`."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator

from models.audit_destination import load_signing_key, parse_store_url

#: What an audit key's id may be: it is stored on every journal event it keys, and printed by `keel audit verify`.
AUDIT_KEY_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: The shortest secret the journal's HMAC takes: 32 bytes, SHA-256's own output size (RFC 2104 §3).
MIN_AUDIT_SECRET_BYTES = 32


class AuditFields(BaseModel):
    """``KEEL_AUDIT_*``."""

    # The journal's key ring (models/audit_keys.py): key id -> secret (at least 32 bytes), as JSON, e.g.
    # {"2025-06": "…"}; each journal event is linked to the previous one with an HMAC under one of them and stores
    # its id. KEEL_AUDIT_KEY_ID names the key new events use (optional when the ring holds one); the others stay to
    # check older events. Unset outside production: a key generated once under KEEL_HOME.
    audit_keys: dict[str, SecretStr] = Field(default_factory=dict)
    audit_key_id: str | None = None
    # The leading beat runs `keel audit verify` (in a thread of its own) this often, incrementally: each chain from
    # its checkpoint; 0: never. Once the last full pass (the beat's or a person's) is this old, the run is a full
    # pass instead (every chain from its start: the only one that sees an edit below a checkpoint); 0: never.
    audit_verify_interval_seconds: float = Field(default=3600.0, ge=0)
    audit_verify_full_interval_seconds: float = Field(default=86400.0, ge=0)
    # Chains a verify walks per transaction: each chunk's snapshot ends with it, so vacuum is held back for one chunk.
    audit_verify_chunk_chains: int = Field(default=500, ge=1, le=100_000)
    # ... and fewer when their walks would read more events than this together (a longer chain is a chunk of its own).
    audit_verify_chunk_events: int = Field(default=50_000, ge=1, le=10_000_000)
    # Shipping the journal to a separate store (agents/audit/ship.py, `keel audit ship`): sealed segments of JSON
    # Lines to s3://bucket/prefix or file:///path; unset, nothing is shipped. The leading beat ships this often
    # (0: only `keel audit ship` does).
    audit_ship_url: str | None = None
    audit_ship_interval_seconds: float = Field(default=60.0, ge=0)
    # A segment closes at this many events, or once its oldest event is this many minutes old.
    audit_segment_events: int = Field(default=1000, ge=1, le=100_000)
    audit_segment_minutes: float = Field(default=10.0, gt=0, le=7 * 24 * 60)
    # How long a shipper waits for the transactions writing the journal when it starts to end (their ids are final
    # only then); past it, the rest waits for the next run (`keel audit ship` exits 75).
    audit_settle_seconds: float = Field(default=30.0, gt=0, le=3600)
    # An S3-compatible store other than AWS (MinIO, Ceph...); credentials and region come from boto3's own
    # environment variables and config files.
    audit_s3_endpoint_url: str | None = None
    # S3 Object Lock on every shipped object: retained this many days (0: no retention headers), in this mode.
    audit_object_lock_days: int = Field(default=0, ge=0, le=36_500)
    audit_object_lock_mode: Literal["COMPLIANCE", "GOVERNANCE"] = "COMPLIANCE"
    # The journal is partitioned by month (docs/audit-retention.md): the leading beat keeps partitions for the current
    # month and this many after it (daily, and when it starts leading). The journal_partitions alert fires below 2.
    audit_partition_months_ahead: int = Field(default=3, ge=2, le=12)
    # An Ed25519 private key (PEM, PKCS#8: `openssl genpkey -algorithm ed25519`): each segment's manifest is also
    # signed with it, so a holder of the public key can check the shipped copy without any secret.
    audit_signing_key: SecretStr | None = None
    # `keel audit archive` takes a month of the journal only once it ended more than this many days ago.
    audit_archive_grace_days: int = Field(default=7, ge=0, le=3650)

    @property
    def current_audit_key_id(self) -> str | None:
        """The id of the key new journal events are linked with: KEEL_AUDIT_KEY_ID, or the ring's only key."""
        if self.audit_key_id is not None:
            return self.audit_key_id
        return next(iter(self.audit_keys), None)

    @field_validator("audit_keys")
    @classmethod
    def _audit_keys_are_named_and_long_enough(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        # Ids are not secret (every event stores one); secrets are never echoed, not even their length's digits.
        for key_id, secret in value.items():
            if not AUDIT_KEY_ID.fullmatch(key_id):
                raise ValueError(
                    f"key id {key_id[:70]!r}: use 1 to 64 letters, digits and . _ - (e.g. 2025-06); it is stored on"
                    " every event the key links"
                )
            if len(secret.get_secret_value().encode()) < MIN_AUDIT_SECRET_BYTES:
                raise ValueError(
                    f"key {key_id!r}: its secret must be at least {MIN_AUDIT_SECRET_BYTES} bytes, e.g. the output of"
                    ' python3 -c "import secrets; print(secrets.token_urlsafe(48))"'
                )
        return value

    @field_validator("audit_ship_url")
    @classmethod
    def _ship_url_is_a_store(cls, value: str | None) -> str | None:
        if value is not None:
            parse_store_url(value)  # ValueError names the rule
        return value

    @field_validator("audit_signing_key")
    @classmethod
    def _signing_key_is_ed25519(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            load_signing_key(value.get_secret_value())  # ValueError names the rule, never the key
        return value
