"""A real S3-compatible server for the shipping tests: moto's server mode, in this process, on 127.0.0.1. Buckets
get names of their own per test; boto3 is pointed at it with throwaway credentials (moto checks none)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import boto3
from botocore.config import Config
from moto.server import ThreadedMotoServer

from tests.support.audit import TEST_ENV, TEST_KEY_ID, TEST_KEYS, TEST_SECRET

#: What boto3 reads its credentials and region from, for the tests and the `keel` processes they start.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/keel-tests-aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/keel-tests-aws-credentials",
}

#: The audit key ring the tests ship with.
# The suite's one key ring (tests/support/audit.py): the events the tests' databases hold are linked with it.
RING = {TEST_KEY_ID: TEST_SECRET}
KEYS = TEST_KEYS
KEYS_ENV = TEST_ENV


class MotoS3:
    def __init__(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)

    def start(self) -> MotoS3:
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self.server.stop()

    def client(self, endpoint: str | None = None, **config: Any) -> Any:
        return boto3.session.Session(
            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=AWS_ENV["AWS_DEFAULT_REGION"],
        ).client("s3", endpoint_url=endpoint or self.url, config=Config(s3={"addressing_style": "path"}, **config))

    def bucket(self, *, object_lock: bool = False) -> str:
        name = f"keel-journal-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name, ObjectLockEnabledForBucket=object_lock)
        return name

    def keys(self, bucket: str) -> list[str]:
        names: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket):
            names += [item["Key"] for item in page.get("Contents", [])]
        return names


def moto_s3() -> Iterator[MotoS3]:
    server = MotoS3().start()
    try:
        yield server
    finally:
        server.stop()
