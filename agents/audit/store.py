"""The separate store the journal is shipped to: an S3-compatible bucket (boto3) or a local directory. A store only ever
adds objects (:meth:`SegmentStore.put_new`): one already there is never overwritten, and one there with other content is
:class:`SegmentConflict`. How: docs/explanation/ingress-and-audit.md#the-store-only-adds-objects."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from models.audit_destination import StoreUrl
from models.errors import KeelError

Written = Literal["written", "present"]


class StoreError(KeelError):
    """The journal's store could not be read or written."""


class SegmentConflict(StoreError):
    """The store already holds an object of this name with other content: a shipped segment is never rewritten."""

    def __init__(self, name: str, where: str) -> None:
        super().__init__(
            f"{where}: {name} is already in the store with other content; shipped segments are never rewritten"
            " (keel audit verify --against names what differs)"
        )
        self.name = name


class SegmentStore(Protocol):
    """Objects by name (``journal/…``), written once."""

    def describe(self) -> str: ...

    def put_new(self, name: str, body: bytes) -> Written: ...

    def get(self, name: str) -> bytes | None: ...

    def names(self, start_after: str = "") -> Iterator[str]:
        """Every object name under ``journal/`` after ``start_after``, in byte order."""
        ...


class FileStore:
    """A directory: each object is a file, made whole (written aside, then linked into place: a link never
    replaces a file that is there)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def describe(self) -> str:
        return f"file://{self.root}"

    def _path(self, name: str) -> Path:
        return self.root / name

    def put_new(self, name: str, body: bytes) -> Written:
        path = self._path(name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            draft = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(body)
                    out.flush()
                    os.fsync(out.fileno())
                try:
                    os.link(draft, path)
                except FileExistsError:
                    if path.read_bytes() == body:
                        return "present"
                    raise SegmentConflict(name, self.describe()) from None
            finally:
                draft.unlink(missing_ok=True)
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as exc:
            raise StoreError(f"{self.describe()}: cannot write {name}: {exc.strerror or exc}") from None
        return "written"

    def get(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"{self.describe()}: cannot read {name}: {exc.strerror or exc}") from None

    def names(self, start_after: str = "") -> Iterator[str]:
        folder = self.root / "journal"
        try:
            found = sorted(f"journal/{p.name}" for p in folder.iterdir() if not p.name.startswith("."))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StoreError(f"{self.describe()}: cannot list journal/: {exc.strerror or exc}") from None
        yield from (name for name in found if name > start_after)


#: S3 errors that say a conditional write is not supported here (then: HEAD first, then write).
_NO_CONDITIONAL = {"NotImplemented", "InvalidArgument", "InvalidRequest"}


class S3Store:
    """A bucket (and key prefix) of an S3-compatible store. Retries of 5xx, throttling and timeouts are botocore's
    (standard mode); each write is conditional, so a retried write that had already landed is found identical."""

    def __init__(
        self,
        url: StoreUrl,
        *,
        endpoint_url: str | None = None,
        lock_days: int = 0,
        lock_mode: str = "COMPLIANCE",
        retain_until: Callable[[int], datetime] | None = None,
        client: Any = None,
        timeout_seconds: float = 30.0,
        max_attempts: int = 5,
    ) -> None:
        self.url = url
        self.lock_days = lock_days
        self.lock_mode = lock_mode
        self.retain_until = retain_until
        self._conditional = True
        self.client = client or self._client(endpoint_url, timeout_seconds, max_attempts)

    def _client(self, endpoint_url: str | None, timeout_seconds: float, max_attempts: int) -> Any:
        try:
            return self._make_client(endpoint_url, timeout_seconds, max_attempts)
        except (BotoCoreError, ValueError) as exc:  # a bad endpoint or region: botocore says ValueError
            raise StoreError(f"{self.describe()}: cannot set up the S3 client: {exc}") from None

    def _make_client(self, endpoint_url: str | None, timeout_seconds: float, max_attempts: int) -> Any:
        return boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            config=Config(
                retries={"mode": "standard", "max_attempts": max_attempts},
                connect_timeout=timeout_seconds,
                read_timeout=timeout_seconds,
                # Stores other than AWS (MinIO, Ceph, a proxy) mostly serve buckets by path, not by host name.
                s3={"addressing_style": "path" if endpoint_url else "auto"},
            ),
        )

    def describe(self) -> str:
        return f"s3://{self.url.bucket}/{self.url.prefix}"

    def _key(self, name: str) -> str:
        return self.url.prefix + name

    @contextlib.contextmanager
    def _errors(self, doing: str, name: str) -> Iterator[None]:
        try:
            yield
        except ClientError as exc:
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            raise StoreError(
                f"{self.describe()}: {doing} {name}: {error.get('Code', status)} {error.get('Message', '')}".rstrip()
            ) from None
        except BotoCoreError as exc:
            raise StoreError(f"{self.describe()}: {doing} {name}: {exc}") from None

    def put_new(self, name: str, body: bytes) -> Written:
        extra: dict[str, Any] = {}
        if self.lock_days:
            if self.retain_until is None:
                raise StoreError("Object Lock retention needs the database's time to count from")
            extra = {
                "ObjectLockMode": self.lock_mode,
                "ObjectLockRetainUntilDate": self.retain_until(self.lock_days),
            }
        if self._conditional:
            try:
                self.client.put_object(Bucket=self.url.bucket, Key=self._key(name), Body=body, IfNoneMatch="*", **extra)
                return "written"
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                    return self._compare(name, body)
                if code not in _NO_CONDITIONAL:
                    with self._errors("writing", name):
                        raise
                self._conditional = False  # this store refuses If-None-Match: ask first from now on
            except BotoCoreError as exc:
                raise StoreError(f"{self.describe()}: writing {name}: {exc}") from None
        if self.get(name) is not None:
            return self._compare(name, body)
        with self._errors("writing", name):
            self.client.put_object(Bucket=self.url.bucket, Key=self._key(name), Body=body, **extra)
        return "written"

    def _compare(self, name: str, body: bytes) -> Written:
        there = self.get(name)
        if there == body:
            return "present"
        raise SegmentConflict(name, self.describe())

    def get(self, name: str) -> bytes | None:
        try:
            answer = self.client.get_object(Bucket=self.url.bucket, Key=self._key(name))
            data: bytes = answer["Body"].read()
            return data
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            with self._errors("reading", name):
                raise
        except BotoCoreError as exc:
            raise StoreError(f"{self.describe()}: reading {name}: {exc}") from None

    def names(self, start_after: str = "") -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.url.bucket,
            Prefix=self._key("journal/"),
            StartAfter=self._key(start_after) if start_after else "",
        )
        with self._errors("listing", "journal/"):
            for page in pages:
                for item in page.get("Contents", []):
                    yield item["Key"][len(self.url.prefix) :]


def open_store(
    url: StoreUrl,
    *,
    endpoint_url: str | None = None,
    lock_days: int = 0,
    lock_mode: str = "COMPLIANCE",
    retain_until: Callable[[int], datetime] | None = None,
) -> SegmentStore:
    """The store ``url`` names."""
    if url.scheme == "file":
        return FileStore(Path(url.prefix))
    return S3Store(url, endpoint_url=endpoint_url, lock_days=lock_days, lock_mode=lock_mode, retain_until=retain_until)
