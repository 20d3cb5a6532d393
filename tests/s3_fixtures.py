"""A real S3 server process for tests of sources in object storage (moto behind
``tools.s3_server``: latency, injected faults, request counts), one per test session.

Use it from a test module (the fixtures are named ``s3_server`` and ``s3``; their functions
have other names, so a test's parameters do not shadow the import)::

    from tests.s3_fixtures import new_bucket, s3_fixture, s3_server_fixture  # noqa: F401

``s3_server`` (session) is the running :class:`~tools.s3_server.S3Server`; ``s3`` (per test)
is the same server with the fake credentials in the environment (as a real client finds
real ones), faults and latency cleared and counters reset before and after the test.
:func:`new_bucket` makes a bucket no other test uses, :func:`upload_tree` copies a local
directory into a bucket prefix and returns its :class:`~omniscale.location.Location`.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import uuid
from pathlib import Path

import pytest

from omniscale.location import Location
from omniscale.tools.s3_server import REGION, S3Server

_lock = threading.Lock()
_server: S3Server | None = None
_buckets = itertools.count()


def shared_server() -> S3Server:
    """The session's server, started on first use (however many modules import the fixture,
    each defining its own copy of it, there is one server per process)."""
    global _server
    with _lock:
        if _server is None:
            _server = S3Server().start()
            atexit.register(_server.stop)
        return _server


@pytest.fixture(scope="session", name="s3_server")
def s3_server_fixture() -> S3Server:
    """The running S3 server (shared by the session; reset what you change, or use ``s3``)."""
    return shared_server()


@pytest.fixture(name="s3")
def s3_fixture(s3_server: S3Server, monkeypatch) -> S3Server:
    """The server, with fake credentials in the environment, no faults, no latency, fresh
    counters."""
    for name, value in S3Server.env().items():
        monkeypatch.setenv(name, value)
    s3_server.control(clear_faults=True, latency_ms=0, reset_stats=True)
    yield s3_server
    s3_server.control(clear_faults=True, latency_ms=0)


def new_bucket(server: S3Server, stem: str = "test") -> str:
    """A new, empty bucket whose name no other test uses."""
    name = f"{stem[:30].lower().replace('_', '-')}-{next(_buckets)}-{uuid.uuid4().hex[:8]}"
    server.make_bucket(name)
    return name


def client(server: S3Server):
    """A boto3 client of the server with the fake credentials (no environment needed)."""
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint, region_name=REGION,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def upload_tree(server: S3Server, local: str | os.PathLike, bucket: str, prefix: str = "",
                storage_options: dict | None = None) -> Location:
    """Every file under ``local`` copied to ``s3://bucket/prefix/<relative path>``; the
    prefix's Location, with the server's storage options (plus ``storage_options``)."""
    s3 = client(server)
    root = Path(local)
    prefix = prefix.strip("/")
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        key = "/".join(filter(None, [prefix, path.relative_to(root).as_posix()]))
        s3.upload_file(str(path), bucket, key)
    url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return Location.of(url, {**server.storage_options, **(storage_options or {})})


def put_object(server: S3Server, bucket: str, key: str, data: bytes) -> None:
    """One object written (or replaced) in the bucket."""
    client(server).put_object(Bucket=bucket, Key=key, Body=data)
