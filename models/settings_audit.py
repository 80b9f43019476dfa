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
    audit_keys: dict[str, SecretStr] = Field(
        default_factory=dict,
        description=(
            "The journal's key ring, as JSON: key id (letters, digits, `. _ -`) → secret of at least 32 bytes; every "
            "event's link is an HMAC under one of them. Required in production; elsewhere, unset: a key generated "
            "once under `KEEL_HOME`."
        ),
    )
    audit_key_id: str | None = Field(
        default=None,
        description=(
            "The key new journal events are linked with; required when the ring holds several. Unset: the ring's only"
            " key."
        ),
    )
    audit_verify_interval_seconds: float = Field(
        default=3600.0,
        ge=0,
        description=(
            "How often the leading beat runs `keel audit verify` (incremental, or a full pass when one is due; in a "
            "thread of its own); `0`: never."
        ),
    )
    audit_verify_full_interval_seconds: float = Field(
        default=86400.0,
        ge=0,
        description=(
            "Once the last full pass recorded (the beat's or a person's) is this old, the beat's run is a full pass: "
            "every chain from its start, the only one that sees an edit below a checkpoint; `0`: never a full one."
        ),
    )
    audit_verify_chunk_chains: int = Field(
        default=500,
        ge=1,
        le=100_000,
        description=(
            "Chains a verify walks per transaction: each chunk's snapshot ends with it, so vacuum is held back for "
            "one chunk, not the whole pass."
        ),
    )
    audit_verify_chunk_events: int = Field(
        default=50_000,
        ge=1,
        le=10_000_000,
        description=(
            "Fewer chains per chunk when their walks would read more events than this together: long chains make "
            "short chunks; a chain longer than this is a chunk of its own."
        ),
    )
    audit_ship_url: str | None = Field(
        default=None,
        description=(
            "Where the journal is shipped: `s3://bucket/prefix` (any S3-compatible store) or `file:///absolute/path`."
            " Unset: nothing is shipped."
        ),
    )
    audit_ship_interval_seconds: float = Field(
        default=60.0,
        ge=0,
        description=(
            "How often the leading beat ships (in a thread of its own) while `KEEL_AUDIT_SHIP_URL` is set; `0`: only "
            "`keel audit ship` does."
        ),
    )
    audit_segment_events: int = Field(
        default=1000,
        ge=1,
        le=100_000,
        description="A shipped segment closes at this many events (or at `KEEL_AUDIT_SEGMENT_MINUTES`).",
    )
    audit_segment_minutes: float = Field(
        default=10.0,
        gt=0,
        le=7 * 24 * 60,
        description=(
            "A shipped segment closes once its oldest event is this many minutes old, on the database's clock (or at "
            "`KEEL_AUDIT_SEGMENT_EVENTS`)."
        ),
    )
    audit_settle_seconds: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "How long a shipper waits for the transactions writing the journal when it starts to end (only then are "
            "their ids final); past it the rest waits for the next run and `keel audit ship` exits 75."
        ),
    )
    audit_s3_endpoint_url: str | None = Field(
        default=None,
        description=(
            "An S3-compatible store other than AWS (MinIO, Ceph…), addressed by path; credentials and region come "
            "from boto3's own variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, …) or "
            "config files."
        ),
    )
    audit_object_lock_days: int = Field(
        default=0,
        ge=0,
        le=36_500,
        description=(
            "S3 Object Lock: every shipped object is retained this many days from its shipping (database clock); `0`:"
            " no retention headers. The bucket must have Object Lock enabled, or every write is refused."
        ),
    )
    audit_object_lock_mode: Literal["COMPLIANCE", "GOVERNANCE"] = Field(
        default="COMPLIANCE",
        description="The S3 Object Lock mode of shipped objects' retention.",
    )
    # The journal is partitioned by month (docs/audit-retention.md).
    audit_partition_months_ahead: int = Field(
        default=3,
        ge=2,
        le=12,
        description=(
            "The leading beat keeps journal partitions for the current month and this many after it, when it starts "
            "leading and daily; the `journal_partitions` alert fires below 2."
        ),
    )
    audit_signing_key: SecretStr | None = Field(
        default=None,
        description=(
            "An Ed25519 private key (PEM, PKCS#8: `openssl genpkey -algorithm ed25519`): shipped segments' manifests "
            "are also signed with it, so the public key alone checks the shipped copy."
        ),
    )
    audit_archive_grace_days: int = Field(
        default=7,
        ge=0,
        le=3650,
        description="`keel audit archive` takes a month only once it ended more than this many days ago.",
    )

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
