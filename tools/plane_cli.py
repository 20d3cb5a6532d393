"""``omniscale plane serve | status | audit | reload``: the data plane from the command line."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys

from omniscale.dataplane.plane_config import POLICIES
from omniscale.errors import UserError


def add_commands(commands) -> None:
    plane = commands.add_parser("plane", help="the data-plane service")
    sub = plane.add_subparsers(dest="plane_command", required=True, metavar="SUBCOMMAND")

    _add_serve(sub)

    for name, helptext in (("status", "mixture, progress and balance of a running plane"),
                           ("reload", "apply a new mixing spec at the next window boundary")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("url")
        add_token_arguments(p)
        add_tls_root_argument(p)
        p.add_argument("--json", action="store_true", help="print JSON")
        if name == "reload":
            p.add_argument("--spec", required=True)
        p.set_defaults(func=_status if name == "status" else _reload)

    audit = sub.add_parser("audit", help="samples planned, committed, duplicated and missing")
    audit.add_argument("state_dir")
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(func=_audit)


def _add_serve(sub) -> None:
    """``plane serve``: where it listens, how it plans, its state."""
    serve = sub.add_parser("serve", help="serve plans over Arrow Flight (prints its URL)")
    serve.add_argument("--spec", help="mixing spec (needed unless --state-dir has a snapshot)")
    serve.add_argument("--state-dir", required=True, help="snapshots and log live here")
    serve.add_argument("--dp", type=int, required=True, help="data-parallel ranks")
    _add_serving_arguments(serve)
    _add_planning_arguments(serve)
    serve.add_argument("--max-sample-tokens", type=int, default=None,
                       help="longer text is truncated, longer media samples skipped "
                            "(default: micro-batch tokens x SP group)")
    serve.add_argument("--snapshot-every", type=int, default=100)
    serve.add_argument("--spec-root", default=None,
                       help="`plane reload` reads specs only under this directory (default: "
                            "the directory of the starting spec)")
    serve.add_argument("--restore-step", type=int, default=None,
                       help="resume from this step's snapshot, rolling back later commits")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="also serve status as Prometheus metrics on this port "
                            "(unauthenticated HTTP, on --metrics-host)")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="where --metrics-port binds (default 127.0.0.1, whatever --host is)")
    serve.add_argument("--ray", action="store_true",
                       help="run the plane as an actor on a Ray cluster (RAY_ADDRESS, or a "
                            "local instance) and wait; Ctrl-C stops it")
    serve.add_argument("--namespace", default=None,
                       help="with --ray: the job's Ray namespace, where the plane actor is "
                            "named 'plane' and trainers using it put their decoding pools "
                            "(default: one of the state dir's own)"),
    serve.set_defaults(func=_serve)


def _add_serving_arguments(serve) -> None:
    """Where ``plane serve`` listens and who may call it."""
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0: any free port")
    add_token_arguments(serve, ": every client must send it (required when --host is not "
                               "loopback)")
    serve.add_argument("--tls-cert", metavar="PEM", help="serve grpc+tls:// (and the plan lane "
                       "over TLS) with this certificate (required off loopback, with --tls-key)")
    serve.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    serve.add_argument("--insecure", action="store_true",
                       help="off loopback, serve plain TCP without TLS (the token then crosses "
                            "the network in clear text)")


def _add_planning_arguments(serve) -> None:
    """How ``plane serve`` plans: windows, batch sizes, costs and the placement policy."""
    serve.add_argument("--window", type=int, default=4, help="global batches planned together")
    batch = serve.add_mutually_exclusive_group(required=True)
    batch.add_argument("--global-batch-tokens", type=int)
    batch.add_argument("--global-batch-samples", type=int)
    serve.add_argument("--micro-batch-tokens", type=int, default=16384)
    serve.add_argument("--sp-max", type=int, default=8)
    serve.add_argument("--costs", metavar="costs.json", default=None,
                       help="cost model of `omniscale balance calibrate` (default: relative "
                            "costs, --cost-linear·L + --cost-quadratic·L²)")
    serve.add_argument("--cost-linear", type=float, default=None, metavar="X",
                       help="the LLM's relative cost per token, X·L (default 24576; the "
                            "trainer's embedded plane uses the model's FLOPs ratio α/β)")
    serve.add_argument("--cost-quadratic", type=float, default=None, metavar="Y",
                       help="the LLM's relative cost of attention, Y·L² (default 1)")
    serve.add_argument("--frozen-encoders", metavar="KINDS", default="",
                       help="encoder kinds whose tower the trainers freeze (optim.groups), "
                            "comma-separated (image,video,audio): priced forward only")
    serve.add_argument("--rank-speeds", metavar="SPEEDS", default=None,
                       help="each data rank's relative speed known ahead, comma-separated "
                            "(1,1,0.5,0.5: mixed GPU generations): work in proportion from "
                            "step 0; measured speeds replace them (default: equal)")
    serve.add_argument("--attention-heads", type=int, default=0, metavar="H",
                       help="the model's query heads per TP rank: with rank speeds, a sample "
                            "split over an SP group may have its heads sized by the ranks' "
                            "speeds too (default 0: not known, H/k heads each)")
    serve.add_argument("--balance", default="omniscale", choices=POLICIES,
                       help="who places samples on ranks: the planner (default) or a baseline "
                            "policy, to compare them on the same run")
    serve.add_argument("--interleave", default="", metavar="P1,P2,...",
                       help="A/B timing in one job: window k planned by the k-th policy of the "
                            "list in turn (instead of --balance), so a machine's drift slows "
                            "each alike (default: every window by --balance)")


def add_token_arguments(parser, note: str = "") -> None:
    """--token-file and --token (one of them; else $OMNISCALE_PLANE_TOKEN): see
    :func:`token_from`."""
    from omniscale.dataplane.auth import TOKEN_ENV

    group = parser.add_mutually_exclusive_group()
    group.add_argument("--token-file", metavar="FILE",
                       help=f"a file holding the plane's bearer token{note} (or set {TOKEN_ENV})")
    group.add_argument("--token", help=f"the token itself: other users see it in `ps`; prefer "
                                       f"--token-file or {TOKEN_ENV}")


def add_tls_root_argument(parser) -> None:
    from omniscale.dataplane.auth import TLS_ROOT_ENV

    parser.add_argument("--tls-root", metavar="PEM",
                        help="for a grpc+tls:// plane: the CA certificate to check it against "
                             f"(its own, if self-signed; or set {TLS_ROOT_ENV}; default: the "
                             "system's CAs)")


def token_from(args: argparse.Namespace) -> str | None:
    """The token of --token-file, --token or $OMNISCALE_PLANE_TOKEN (in that order)."""
    from omniscale.dataplane.auth import resolve_token

    return resolve_token(args.token, args.token_file)


def _serve(args: argparse.Namespace) -> int:
    from omniscale.dataplane.auth import check_bind, read_pem

    args.token = token_from(args)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("--tls-cert and --tls-key go together (a certificate and its key)")
    if args.tls_cert is not None:
        read_pem(args.tls_cert, "--tls-cert")
        read_pem(args.tls_key, "--tls-key")
    check_bind(args.host, args.token, args.tls_cert is not None, args.insecure)
    return (_serve_on_ray if args.ray else _serve_here)(args, serve_config(args))


def serve_config(args: argparse.Namespace):
    """The ``PlaneConfig`` of ``plane serve``'s flags."""
    from omniscale.dataplane.plane import PlaneConfig
    from omniscale.tools.balance_input import rank_speeds

    return PlaneConfig(
        dp=args.dp, micro_batch_tokens=args.micro_batch_tokens, window=args.window,
        global_batch_tokens=args.global_batch_tokens,
        global_batch_samples=args.global_batch_samples, sp_max=args.sp_max,
        snapshot_every=args.snapshot_every, max_sample_tokens=args.max_sample_tokens,
        balance=args.balance, interleave=tuple(p.strip() for p in args.interleave.split(",")
                                                 if p.strip()), **_costs(args),
        frozen_encoders=tuple(k.strip() for k in args.frozen_encoders.split(",") if k.strip()),
        rank_speed=rank_speeds(args.rank_speeds), attention_heads=args.attention_heads)


def _costs(args: argparse.Namespace) -> dict:
    """The starting cost model: a calibration (``--costs``) or the LLM's two relative
    coefficients (``--cost-linear``/``--cost-quadratic``, each defaulting to PlaneConfig's);
    checked as the plane checks a refit (``DataPlane.set_costs``)."""
    from omniscale.dataplane.actions import MAX_COST, cost_in_range

    given = {name: value for name, value in (("cost_linear", args.cost_linear),
                                             ("cost_quadratic", args.cost_quadratic))
             if value is not None}
    if args.costs is not None:
        if given:  # a calibration has its own LLM coefficients, in seconds
            raise UserError("--costs and --cost-linear/--cost-quadratic: give one cost model "
                            "(a calibration brings its own LLM coefficients)")
        from omniscale.tools.train.cost_model import read_cost_file

        return read_cost_file(args.costs)
    for name, value in given.items():
        if not cost_in_range(value):
            raise UserError(f"--{name.replace('_', '-')} {value:g}: must be finite, in [0, "
                            f"{MAX_COST:g}]")
    if given and not any(given.get(n, 1.0) for n in ("cost_linear", "cost_quadratic")):
        raise UserError("--cost-linear and --cost-quadratic: not both 0 (every sample would "
                        "cost nothing)")
    return given


def _serve_here(args: argparse.Namespace, config) -> int:
    from omniscale.dataplane.plane import DataPlane
    from omniscale.dataplane.server import PlaneServer

    plane = DataPlane(args.spec, args.state_dir, config, restore_step=args.restore_step,
                      spec_root=args.spec_root)
    # Everything that can fail to bind binds before the URL is announced: a script that
    # waits for the "serving" line never sees a plane that then dies.
    metrics = _metrics(plane, args)
    try:
        _check_bindable(args.host, args.port)
        server = PlaneServer(plane, args.host, args.port, args.token, tls_cert=args.tls_cert,
                             tls_key=args.tls_key, insecure=args.insecure).start()
    except Exception as e:  # noqa: BLE001 -- pyarrow says only "Server did not start properly"
        if metrics is not None:
            metrics.shutdown()
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise UserError(f"--host {args.host} --port {args.port}: cannot serve there ({why}): "
                        "the port in use, or the address not this host's") from None
    signals = StopSignals()
    print(f"omniscale plane: serving {server.url} (step {plane.next_step}, "
          f"{plane.dp_at(plane.next_step)} ranks, state in {args.state_dir})", flush=True)
    signals.wait()
    server.stop()
    if metrics is not None:
        metrics.shutdown()
    plane.snapshot()
    print(f"omniscale plane: stopped at step {plane.next_step}", flush=True)
    return 0


def _serve_on_ray(args: argparse.Namespace, config) -> int:
    import os

    import ray

    from omniscale.dataplane.auth import TLS_ROOT_ENV
    from omniscale.dataplane.client import PlaneClient
    from omniscale.dataplane.ray_actor import start_on_ray
    from omniscale.loaders.ray_cluster import job_namespace

    namespace = args.namespace or job_namespace(args.state_dir)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", namespace=namespace, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, namespace=namespace, log_to_driver=False)
    actor = None
    try:
        actor, url = start_on_ray(args.spec, args.state_dir, config, host=args.host,
                                  port=args.port, token=args.token,
                                  restore_step=args.restore_step, tls_cert=args.tls_cert,
                                  tls_key=args.tls_key, insecure=args.insecure,
                                  spec_root=args.spec_root, name="plane")
        signals = StopSignals()
        print(f"omniscale plane: serving {url} from a Ray actor 'plane' in namespace "
              f"{namespace} (state in {args.state_dir})", flush=True)
        # The metrics endpoint stays in this process and reads status over Flight (TLS:
        # checked against $OMNISCALE_PLANE_TLS_ROOT, else the plane's own certificate).
        root = os.environ.get(TLS_ROOT_ENV) or args.tls_cert
        metrics = _metrics(PlaneClient(url, token=args.token, timeout=10, retry_for=5,
                                       tls_root=root), args)
        signals.wait()
        if metrics is not None:
            metrics.shutdown()
        stopped = ray.get(actor.stop.remote(), timeout=60)
        print(f"omniscale plane: stopped at step {stopped['next_step']}", flush=True)
    finally:
        if actor is not None:
            ray.kill(actor)
        ray.shutdown()
    return 0


def _check_bindable(host: str, port: int) -> None:
    """Bind ``host:port`` once ourselves (and let go): gRPC reports a port in use only as
    "Server did not start properly" after lines of its own on stderr."""
    import socket

    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart's TIME_WAIT
        probe.bind((host, port))


def _metrics(plane, args: argparse.Namespace):
    if args.metrics_port is None:
        return None
    from omniscale.dataplane.metrics import serve_metrics

    try:
        server = serve_metrics(plane, args.metrics_host, args.metrics_port)
    except OSError as e:
        raise UserError(f"--metrics-host {args.metrics_host} --metrics-port "
                        f"{args.metrics_port}: cannot serve there ({e.strerror or e})") from None
    print(f"omniscale plane: metrics at {server.url}", flush=True)
    return server


class StopSignals:
    """SIGINT or SIGTERM, waited for on the main thread. The kernel hands a process's signal
    to any of its threads (gRPC's and Arrow's included) and Python runs the handler only on the
    main thread, between bytecodes: a main thread blocked on a lock sleeps through a signal
    another thread took (the plane then never stopped; ``bench plane`` hung on it). The
    C-level handler writes the signal's number to the wakeup socket from whichever thread took
    it, so the main thread waits by reading that socket. Install before announcing the URL: a
    script's SIGTERM right after the "serving" line still stops the plane cleanly."""

    STOP = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)  # the handler must never block
        for sig in self.STOP:
            signal.signal(sig, lambda *_: None)  # a Python handler: the default would kill
        signal.set_wakeup_fd(self._write.fileno())

    def wait(self) -> None:
        stops = {int(sig) for sig in self.STOP}
        while not stops.intersection(self._read.recv(64)):
            pass
        signal.set_wakeup_fd(-1)
        self._read.close()
        self._write.close()


def _client(args):
    from omniscale.dataplane.client import PlaneClient

    return PlaneClient(args.url, token=token_from(args), timeout=10, retry_for=5,
                       tls_root=args.tls_root)


def _status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        from omniscale.tools.plane_status import print_status
        print_status(status)
    return 0


def _reload(args: argparse.Namespace) -> int:
    with _client(args) as client:
        reply = client.reload(args.spec)
    print(json.dumps(reply) if args.json else
          f"{reply['spec']}: applies from step {reply['applies_at_step']}")
    return 0


def _audit(args: argparse.Namespace) -> int:
    from omniscale.dataplane.audit import audit_state_dir

    report = audit_state_dir(args.state_dir)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{args.state_dir}: audit through step {report['next_step'] - 1}")
        columns = ("epoch", "planned", "committed", "in_flight", "not_drawn", "duplicated",
                   "missing")
        table.add_column("source")
        for col in columns:
            table.add_column(col, justify="right")
        table.add_column("complete")
        shown = {True: "yes", False: "no", None: "-"}  # None: the source left the mixture
        for row in report["rows"]:
            table.add_row(row["source"], *(str(row[c]) for c in columns),
                          shown[row["complete"]])
        Console(width=None if sys.stdout.isatty() else 100).print(table)
        print(f"duplicated {report['duplicated']}, missing {report['missing']}, fingerprint "
              f"mismatches {len(report['fingerprint_mismatches'])}")
    bad = report["duplicated"] or report["missing"] or report["fingerprint_mismatches"]
    return 1 if bad else 0
