"""A local S3-compatible server for tests, benchmarks and trying the object-store path.

``python -m omniscale.tools.s3_server --port 9000 [--latency-ms 20]`` serves moto's S3
implementation over HTTP on 127.0.0.1 (a real server process: clients talk to it through
botocore/s3fs exactly as to AWS). A WSGI layer in front of moto adds what a real store does
to a loader and moto does not:

- ``latency_ms``: a delay per request, on the server side (every request pays it);
- faults: the next ``n`` requests whose path contains ``match`` (and whose method is
  ``method``, if given) answer 503 ``SlowDown`` (throttling), 404 ``NoSuchKey``, or hang for
  ``hang_s`` seconds (a time-out);
- counters: requests and response bytes, per method and per kind of object (index,
  shard, other).

Both are driven over HTTP at ``/_omniscale/control`` (POST JSON: ``{"latency_ms": 20}``,
``{"fault": {"kind": "slowdown", "n": 3, "match": "shard-0"}}``, ``{"reset_stats": true}``)
and read at ``/_omniscale/stats``, so a test or benchmark changes them while the server runs.
:class:`S3Server` starts one in a subprocess on a free port and waits until it answers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

CONTROL = "/_omniscale/control"
STATS = "/_omniscale/stats"
REGION = "us-east-1"
# moto accepts any key pair; these are the conventional fake ones (never real credentials).
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": REGION}

_ERRORS = {
    "slowdown": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
    "missing": ("404 Not Found", "NoSuchKey", "The specified key does not exist."),
    "error": ("500 Internal Server Error", "InternalError", "We encountered an internal error."),
}


class FaultLayer:
    """WSGI middleware in front of moto: latency, injected faults, counters."""

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.latency_s = 0.0
        self.faults: list[dict] = []
        self.stats = _empty_stats()

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == CONTROL:
            return self._control(environ, start_response)
        if path == STATS:
            with self.lock:
                body = json.dumps(self.stats).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        method = environ.get("REQUEST_METHOD", "GET")
        with self.lock:
            delay = self.latency_s
            fault = self._take_fault(method, path)
            self.stats["requests"] += 1
            self.stats["by_method"][method] = self.stats["by_method"].get(method, 0) + 1
            kind = _kind(path)
            self.stats["by_kind"][kind] = self.stats["by_kind"].get(kind, 0) + 1
        if delay:
            time.sleep(delay)
        if fault is not None:
            with self.lock:
                self.stats["faults"] += 1
            if fault["kind"] == "hang":
                time.sleep(float(fault.get("hang_s", 30)))
                fault = {"kind": "error"}
            status, code, message = _ERRORS[fault["kind"]]
            body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f"<Message>{message}</Message></Error>").encode()
            start_response(status, [("Content-Type", "application/xml"),
                                    ("Content-Length", str(len(body)))])
            return [body]
        out = self.app(environ, start_response)
        return _Counted(out, self)

    def _take_fault(self, method: str, path: str) -> dict | None:
        for fault in self.faults:
            if fault.get("match", "") in path and fault.get("method", method) == method:
                fault["n"] -= 1
                if fault["n"] <= 0:
                    self.faults.remove(fault)
                return fault
        return None

    def _control(self, environ, start_response):
        size = int(environ.get("CONTENT_LENGTH") or 0)
        order = json.loads(environ["wsgi.input"].read(size) or b"{}")
        with self.lock:
            if "latency_ms" in order:
                self.latency_s = float(order["latency_ms"]) / 1000
            if "fault" in order:
                fault = dict(order["fault"])
                if fault.get("kind") not in (*_ERRORS, "hang"):
                    start_response("400 Bad Request", [("Content-Type", "text/plain")])
                    return [f"unknown fault kind {fault.get('kind')!r}".encode()]
                fault["n"] = int(fault.get("n", 1))
                self.faults.append(fault)
            if order.get("clear_faults"):
                self.faults.clear()
            if order.get("reset_stats"):
                self.stats = _empty_stats()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b"{}"]


class _Counted:
    """The response body, its bytes counted as they leave."""

    def __init__(self, body, layer: FaultLayer) -> None:
        self.body, self.layer = body, layer

    def __iter__(self):
        for chunk in self.body:
            with self.layer.lock:
                self.layer.stats["bytes_out"] += len(chunk)
            yield chunk

    def close(self) -> None:
        if hasattr(self.body, "close"):
            self.body.close()


def _empty_stats() -> dict:
    return {"requests": 0, "bytes_out": 0, "faults": 0, "by_method": {}, "by_kind": {}}


def _kind(path: str) -> str:
    """What a request is for, by its object's name: ``index``, ``shard`` or ``other``
    (listings, buckets)."""
    if path.endswith("_index.parquet"):
        return "index"
    if path.endswith((".tar", ".parquet", ".jsonl")):
        return "shard"
    return "other"


def serve(port: int, host: str = "127.0.0.1", latency_ms: float = 0.0,
          buckets: tuple[str, ...] = ()) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))
    for name, value in FAKE_CREDENTIALS.items():
        os.environ.setdefault(name, value)
    layer = FaultLayer(DomainDispatcherApplication(create_backend_app))
    layer.latency_s = latency_ms / 1000
    print(f"s3 server: http://{host}:{port} (moto; latency {latency_ms:g} ms per request)",
          flush=True)
    if buckets:
        server = S3Server(port=port)
        threading.Thread(target=server.wait_and_make, args=(buckets,), daemon=True).start()
    run_simple(host, port, layer, threaded=True, use_reloader=False)


@dataclass
class S3Server:
    """A local S3 server in a subprocess: ``with S3Server() as s3: s3.endpoint``.

    ``storage_options`` are what a spec's source needs to reach it (endpoint and region; the
    fake credentials come from the environment, as real ones would: :meth:`env`).
    """

    latency_ms: float = 0.0
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "client_kwargs": {"region_name": REGION}}

    @staticmethod
    def env() -> dict:
        """The fake credentials, for ``os.environ.update`` in a test or a child process."""
        return dict(FAKE_CREDENTIALS)

    def start(self, timeout: float = 60.0) -> "S3Server":
        self.port = self.port or _free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "omniscale.tools.s3_server", "--port", str(self.port),
             "--latency-ms", str(self.latency_ms)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, **FAKE_CREDENTIALS})
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.stats()
                return self
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"s3 server exited with {self.process.returncode} "
                                       "before answering") from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"s3 server did not answer within {timeout:g} s"
                                       ) from None
                time.sleep(0.05)  # polling a starting process: there is nothing to wait on

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def wait_and_make(self, buckets, timeout: float = 60.0) -> None:
        """Create ``buckets`` once the server answers (the CLI's ``--bucket``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.stats()
                break
            except OSError:
                time.sleep(0.05)  # the server is starting on the main thread
        for name in buckets:
            self.make_bucket(name)
            print(f"s3 server: bucket s3://{name}", flush=True)

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` (s3fs's mkdir sends a location constraint that us-east-1
        refuses)."""
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                     aws_access_key_id="testing", aws_secret_access_key="testing"
                     ).create_bucket(Bucket=name)

    def control(self, **order) -> None:
        request = urllib.request.Request(self.endpoint + CONTROL, method="POST",
                                         data=json.dumps(order).encode())
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def stats(self) -> dict:
        with urllib.request.urlopen(self.endpoint + STATS, timeout=5) as response:
            return json.loads(response.read())

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="delay added to every request, server side")
    parser.add_argument("--bucket", action="append", default=[], metavar="NAME",
                        help="create this bucket at start (repeatable)")
    args = parser.parse_args(argv)
    serve(args.port, args.host, args.latency_ms, tuple(args.bucket))
    return 0


if __name__ == "__main__":
    sys.exit(main())
