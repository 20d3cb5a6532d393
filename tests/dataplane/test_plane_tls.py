"""TLS on Flight and on the plan lane, binding beyond loopback, and where tokens come from
(--token-file, OMNISCALE_PLANE_TOKEN): real servers, real TLS handshakes, a certificate made
at test time. Only 127.0.0.0/8 is ever sent to; 0.0.0.0 is only bound."""

from __future__ import annotations

import datetime
import json
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys

import pyarrow as pa
import pytest

from omniscale.dataplane import wire
from omniscale.dataplane.auth import TLS_ROOT_ENV, TOKEN_ENV, check_bind, resolve_token
from omniscale.dataplane.client import PlaneClient, PlaneError, _lane_reply
from omniscale.dataplane.lane import LANE_OK, LANE_REFUSED, LaneLimits, lane_frame
from omniscale.dataplane.server import PlaneServer
from omniscale.errors import UserError
from omniscale.tools.cli import build_parser, main
from omniscale.tools.plane_cli import token_from
from tests.procs import Proc


def make_cert(directory, name: str) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key (PEM paths)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor an openssl binary")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True)
        return str(cert), str(key)
    import ipaddress

    private = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    built = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
             .public_key(private.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.SubjectAlternativeName(names), critical=False)
             .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
             .sign(private, hashes.SHA256()))
    cert.write_bytes(built.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    return make_cert(directory, "plane"), make_cert(directory, "other")


class PlanService:
    def __init__(self, rows: int = 3):
        self.rows = rows

    def get_plan(self, step, rank):
        n = self.rows
        return pa.table({"step": [step] * n, "rank": [rank] * n, "sample": list(range(n))})

    def status(self):
        return {"ahead": 3}


def tls_server(certs, rows: int = 3, **limits) -> PlaneServer:
    (cert, key), _ = certs
    return PlaneServer(PlanService(rows), token="s3cret", tls_cert=cert, tls_key=key,
                       lane_limits=LaneLimits(**limits)).start()


def tls_lane(server: PlaneServer, root: str) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=root)
    raw = socket.create_connection(("127.0.0.1", server.lane.port), timeout=10)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def one_line(message: str) -> bool:
    return "\n" not in message and "Traceback" not in message


def test_tls_serves_plans_over_flight_and_the_lane(certs):
    server = tls_server(certs)
    (cert, _), _ = certs
    try:
        assert server.url.startswith("grpc+tls://127.0.0.1:")
        with PlaneClient(server.url, token="s3cret", stream=True, tls_root=cert) as lane, \
                PlaneClient(server.url, token="s3cret", tls_root=cert) as action:
            for step, rank in ((0, 0), (5, 2), (5, 3)):
                assert lane.get_plan(step, rank).equals(action.get_plan(step, rank))
            assert isinstance(lane._lane, ssl.SSLSocket) and lane._stream is None
            assert lane.status() == {"ahead": 3}
    finally:
        server.stop()


def test_tls_lane_sends_big_pipelined_replies_whole(certs):
    """Replies of megabytes, three asked at once: the lane's TLS writes must wait for the
    socket (SSLWantWriteError) and resume with the same bytes."""
    server = tls_server(certs, rows=200_000)
    (cert, _), _ = certs
    try:
        sock = tls_lane(server, cert)
        sock.sendall(lane_frame(wire.encode({"token": "s3cret"})))
        assert _lane_reply(sock)[0] == LANE_OK
        sock.sendall(b"".join(lane_frame(wire.plan_request(s, 1)) for s in (1, 2, 3)))
        data = bytearray()
        for step in (1, 2, 3):
            while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "little"):
                chunk = sock.recv(1 << 20)
                assert chunk, "the lane closed mid-reply"
                data += chunk
            size = int.from_bytes(data[:4], "little")
            assert data[4] == LANE_OK
            plan = pa.ipc.open_stream(bytes(data[5:4 + size])).read_all()
            assert plan.num_rows == 200_000 and plan.column("step")[0].as_py() == step
            del data[:4 + size]
        sock.close()
    finally:
        server.stop()


def test_tls_refusals_are_one_line(certs, tmp_path):
    server = tls_server(certs)
    (cert, _), (other, _) = certs
    try:
        plain = server.url.replace("grpc+tls://", "grpc+tcp://")
        with pytest.raises(PlaneError) as no_tls:
            PlaneClient(plain, token="s3cret", retry_for=0.5).status()
        with pytest.raises(PlaneError, match="certificate verify failed") as wrong_root:
            PlaneClient(server.url, token="s3cret", retry_for=0.5, tls_root=other).status()
        with pytest.raises(PlaneError, match="missing or wrong token") as wrong_token:
            PlaneClient(server.url, token="nope", retry_for=0.5, tls_root=cert).status()
        for refused in (no_tls, wrong_root, wrong_token):
            assert one_line(str(refused.value))
        with pytest.raises(UserError, match=r"^--tls-root \S+: cannot read it"):
            PlaneClient(server.url, tls_root=str(tmp_path / "absent.pem"))
    finally:
        server.stop()


def test_tls_lane_refuses_plain_tcp_wrong_roots_and_slow_handshakes(certs):
    server = tls_server(certs, hello_timeout_s=0.3)
    (cert, _), (other, _) = certs
    try:
        plain = socket.create_connection(("127.0.0.1", server.lane.port), timeout=10)
        plain.sendall(lane_frame(wire.encode({"token": "s3cret"})))  # not a TLS ClientHello
        try:
            assert plain.recv(1) == b""
        except ConnectionResetError:
            pass
        with pytest.raises(ssl.SSLCertVerificationError):
            tls_lane(server, other)
        silent = socket.create_connection(("127.0.0.1", server.lane.port), timeout=10)
        mute = tls_lane(server, cert)  # handshake done, no hello
        assert silent.recv(1) == b""  # closed after the hello timeout
        assert mute.recv(1) == b""
        wrong = tls_lane(server, cert)
        wrong.sendall(lane_frame(wire.encode({"token": "nope"})))
        status, data = _lane_reply(wrong)
        assert status == LANE_REFUSED and wire.decode(bytes(data))["error"] == \
            "missing or wrong token"
        for sock in (plain, silent, mute, wrong):
            sock.close()
        with PlaneClient(server.url, token="s3cret", stream=True, tls_root=cert) as client:
            assert client.get_plan(1, 1).num_rows == 3  # still serving
    finally:
        server.stop()


def test_binding_beyond_loopback_needs_a_token_and_tls_or_insecure(certs):
    (cert, key), _ = certs
    refusals = {
        (None, False, False): "requires --token-file FILE (or OMNISCALE_PLANE_TOKEN) and "
                              "--tls-cert/--tls-key (or --insecure to serve plain TCP)",
        ("t", False, False): "requires --tls-cert/--tls-key (or --insecure to serve plain TCP)",
        (None, True, False): "requires --token-file FILE (or OMNISCALE_PLANE_TOKEN)",
        (None, False, True): "requires --token-file FILE (or OMNISCALE_PLANE_TOKEN)",
    }
    for (token, tls, insecure), expected in refusals.items():
        with pytest.raises(UserError) as refused:
            check_bind("0.0.0.0", token, tls, insecure)
        assert str(refused.value) == f"--host 0.0.0.0: binding anything but loopback {expected}"
    check_bind("0.0.0.0", "t", True)
    check_bind("0.0.0.0", "t", False, insecure=True)
    check_bind("127.0.0.2", None, False)  # loopback: nothing needed
    with pytest.raises(UserError, match="requires --tls-cert/--tls-key"):
        PlaneServer(PlanService(), host="0.0.0.0", token="t")
    with pytest.raises(UserError, match="--tls-cert and --tls-key go together"):
        PlaneServer(PlanService(), tls_cert=cert)
    for options, scheme, root in (({"insecure": True}, "grpc+tcp", None),
                                  ({"tls_cert": cert, "tls_key": key}, "grpc+tls", cert)):
        server = PlaneServer(PlanService(), host="0.0.0.0", token="t", **options).start()
        try:  # bound to every interface; spoken to on loopback only
            assert server.url == f"{scheme}://0.0.0.0:{server.port}"
            url = f"{scheme}://127.0.0.1:{server.port}"
            with PlaneClient(url, token="t", stream=True, tls_root=root) as client:
                assert client.get_plan(2, 0).num_rows == 3 and client._lane is not None
        finally:
            server.stop()


def test_serve_refuses_a_bare_network_bind_in_one_line(capsys, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t\n")
    base = ["plane", "serve", "--state-dir", str(tmp_path / "state"), "--dp", "2",
            "--global-batch-tokens", "4096", "--host", "0.0.0.0"]
    assert main(base + ["--token-file", str(token_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tls-cert/--tls-key (or --insecure" in err
    assert main(base + ["--token-file", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err == \
        f"omniscale: error: --token-file {tmp_path / 'absent'}: no such file\n"


def test_token_sources(tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret\n")
    assert resolve_token(token_file=token_file, environ={}) == "s3cret"
    assert resolve_token("given", environ={TOKEN_ENV: "env"}) == "given"
    assert resolve_token(environ={TOKEN_ENV: "env"}) == "env"
    assert resolve_token(environ={TOKEN_ENV: ""}) is None
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "two").write_text("a\nb\n")
    for path, why in ((tmp_path / "absent", "no such file"), (tmp_path / "empty",
                      "the file is empty"), (tmp_path, "cannot read it (Is a directory)"),
                      (tmp_path / "two", "expected one line (the token), got 2")):
        with pytest.raises(UserError) as refused:
            resolve_token(token_file=path)
        assert str(refused.value) == f"--token-file {path}: {why}"
    args = build_parser().parse_args(["train", "--plane", "grpc+tcp://127.0.0.1:1",
                                      "--token-file", str(token_file)])
    assert token_from(args) == "s3cret"
    train = ["train", "absent.yaml", "--plane", "grpc+tls://127.0.0.1:1"]
    for extra, error in ((["--token-file", str(tmp_path / "absent")], "no such file"),
                         (["--tls-root", str(tmp_path / "absent.pem")], "cannot read it")):
        assert main(train + extra) == 2  # refused before anything is trained
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"omniscale: error: {extra[0]} ") \
            and error in err
    with pytest.raises(SystemExit):  # one source on the command line, not both
        build_parser().parse_args(["plane", "status", "u", "--token", "a", "--token-file", "f"])


def test_client_commands_take_the_token_from_a_file_or_the_environment(certs, tmp_path,
                                                                       capsys, monkeypatch):
    server = tls_server(certs)
    (cert, _), _ = certs
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("s3cret\n")
    bad.write_text("nope\n")
    try:
        status = ["plane", "status", server.url, "--json", "--tls-root", cert]
        assert main(status + ["--token-file", str(good)]) == 0
        assert json.loads(capsys.readouterr().out) == {"ahead": 3}
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        assert main(status) == 0
        assert json.loads(capsys.readouterr().out) == {"ahead": 3}
        assert main(status + ["--token-file", str(bad)]) == 2  # the file wins over the env
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.rstrip().endswith("missing or wrong token")
        monkeypatch.delenv(TOKEN_ENV)
        assert main(status) == 2
        assert "missing or wrong token" in capsys.readouterr().err
        monkeypatch.setenv(TLS_ROOT_ENV, cert)  # the root from the environment (train's ranks)
        assert main(["plane", "status", server.url, "--json", "--token-file", str(good)]) == 0
        assert json.loads(capsys.readouterr().out) == {"ahead": 3}
        monkeypatch.setenv(TLS_ROOT_ENV, str(tmp_path / "absent.pem"))
        with pytest.raises(UserError, match=r"^\$OMNISCALE_PLANE_TLS_ROOT \S+: cannot read"):
            PlaneClient(server.url)
    finally:
        server.stop()


@pytest.mark.slow
def test_serve_command_with_tls_a_token_file_and_local_metrics(demo, certs, tmp_path):
    (cert, key), _ = certs
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    plane = Proc([sys.executable, "-m", "omniscale", "plane", "serve", "--spec",
                  str(demo / "mix.yaml"), "--state-dir", str(tmp_path / "state"), "--dp", "2",
                  "--window", "4", "--global-batch-tokens", "12288", "--micro-batch-tokens",
                  "8192", "--sp-max", "2", "--host", "0.0.0.0", "--token-file", str(token_file),
                  "--tls-cert", cert, "--tls-key", key, "--metrics-port", "0"], timeout=60)
    try:
        # the metrics endpoint binds (and says so) before the URL is announced
        assert re.search(r"^http://127\.0\.0\.1:\d+/metrics$",
                         plane.wait_for(r"metrics at (\S+)").group(1))
        port = int(plane.wait_for(r"serving grpc\+tls://0\.0\.0\.0:(\d+)").group(1))
        url = f"grpc+tls://127.0.0.1:{port}"
        with PlaneClient(url, token="s3cret", stream=True, tls_root=cert) as client:
            assert client.get_plan(0, 1).num_rows > 0
            assert isinstance(client._lane, ssl.SSLSocket)
        with pytest.raises(PlaneError, match="missing or wrong token"):
            PlaneClient(url, tls_root=cert, retry_for=5).status()
        plane.popen.send_signal(signal.SIGTERM)
        plane.wait_for(r"stopped at step 0")
        plane.finish()
    finally:
        plane.kill()


def test_the_ray_actor_class_serves_tls(demo, certs, tmp_path):
    """PlaneActor is a plain class (Ray only places it): TLS arguments reach its server."""
    from omniscale.dataplane.plane import PlaneConfig
    from omniscale.dataplane.ray_actor import PlaneActor

    (cert, key), _ = certs
    config = {"dp": 2, "micro_batch_tokens": 8192, "window": 4, "global_batch_tokens": 12288,
              "sp_max": 2}
    assert set(config) <= set(PlaneConfig.__dataclass_fields__)
    actor = PlaneActor(str(demo / "mix.yaml"), str(tmp_path / "state"), config,
                       token="s3cret", tls_cert=cert, tls_key=key)
    try:
        assert actor.url().startswith("grpc+tls://127.0.0.1:")
        with PlaneClient(actor.url(), token="s3cret", tls_root=cert) as client:
            assert client.get_plan(0, 0).num_rows > 0
    finally:
        actor.stop()
