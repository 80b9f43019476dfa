"""Where the journal is shipped (``KEEL_AUDIT_SHIP_URL``) and the key its manifests are signed with
(``KEEL_AUDIT_SIGNING_KEY``): parsed here, so that settings refuse a bad value before anything runs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# S3's own rule for bucket names (3 to 63 lower-case letters, digits, dots and hyphens).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True, slots=True)
class StoreUrl:
    """A parsed destination: ``s3://bucket/prefix`` (prefix may be empty) or ``file:///absolute/path``."""

    scheme: Literal["s3", "file"]
    bucket: str  # s3 only
    prefix: str  # s3: the key prefix, "" or ending in "/"; file: the directory
    text: str

    def __str__(self) -> str:
        return self.text


def parse_store_url(text: str) -> StoreUrl:
    """The destination ``text`` names, or ValueError saying what a destination looks like."""
    parts = urlsplit(text.strip())
    if parts.scheme == "s3":
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ValueError(
                f"{text!r}: an s3:// destination is s3://bucket/prefix, no credentials, query or fragment"
                " (credentials come from boto3's own environment variables or config files)"
            )
        if not _BUCKET.fullmatch(parts.hostname or ""):
            raise ValueError(f"{text!r}: {parts.netloc!r} is not an S3 bucket name (3-63 of a-z 0-9 . -)")
        prefix = parts.path.strip("/")
        return StoreUrl("s3", parts.netloc, f"{prefix}/" if prefix else "", text.strip())
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/") or parts.query:
            raise ValueError(f"{text!r}: a file:// destination is file:///absolute/path (three slashes)")
        return StoreUrl("file", "", str(Path(unquote(parts.path))), text.strip())
    raise ValueError(f"{text[:100]!r}: the journal ships to s3://bucket/prefix or file:///absolute/path")


def load_signing_key(pem: str) -> Ed25519PrivateKey:
    """The Ed25519 private key in ``pem`` (PKCS#8), or ValueError that does not quote it."""
    try:
        key = serialization.load_pem_private_key(pem.encode(), password=None)
    except (ValueError, TypeError):
        raise ValueError(
            "not a PEM private key without a passphrase (make one with: openssl genpkey -algorithm ed25519)"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("must be an Ed25519 key (openssl genpkey -algorithm ed25519)")
    return key


def load_public_key(pem: bytes) -> Ed25519PublicKey:
    """The Ed25519 public key in ``pem``, or ValueError."""
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError):
        raise ValueError("not a PEM public key (openssl pkey -in private.pem -pubout)") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("must be an Ed25519 public key")
    return key
