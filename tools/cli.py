"""The ``omniscale`` command line.

Every subcommand turns a :class:`omniscale.errors.UserError` into one line on stderr and a
non-zero exit; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omniscale.errors import UserError

EXIT_USER_ERROR = 2


def _report(args: argparse.Namespace) -> int:
    from omniscale.tools.report import report_command

    return report_command(args.run_dir, args.out)


def _bench_all(args: argparse.Namespace) -> int:
    from omniscale.tools.bench.all import run_all, select

    return run_all(select(args.only), args.quick, Path(args.out), write_docs=args.write_docs)


def _train(args: argparse.Namespace) -> int:
    import os

    from omniscale.tools.train.fork_server import start_early
    from omniscale.tools.train.torchrun import under_torchrun

    if args.nproc > 1 and not under_torchrun():  # ranks forked from a server: start it now
        start_early()
    from omniscale.dataplane.auth import TLS_ROOT_ENV, read_pem
    from omniscale.tools.plane_cli import token_from
    from omniscale.tools.train.launch import train

    token = token_from(args) if args.plane else None
    if args.tls_root:  # through the environment: every rank's clients (spawned ones too) read it
        read_pem(args.tls_root, "--tls-root")
        os.environ[TLS_ROOT_ENV] = str(Path(args.tls_root).resolve())
    sets = list(args.set or [])
    if args.ray_address:
        sets += ["data.loader=ray", f"data.ray_address={args.ray_address}"]
    train(args.config, nproc=args.nproc, resume=args.resume, sets=sets,
          progress=not args.no_progress, plane=args.plane, plane_token=token)
    return 0


# tools/bench/all.py's BENCHES, in order: a copy, since --help must work where tools/bench is
# absent (tests/tools/test_bench_all.py checks it)
BENCH_NAMES = ("balance", "linear_ce_memory", "hf_load_memory", "kernels", "model", "attention",
               "commit", "loader", "ray_loader", "remote", "plane", "e2e", "e2e_long_tail",
               "gpu_check", "e2e_uneven", "e2e_uneven_turns", "e2e_no_reshard", "loader_image",
               "balance_scale", "plane_scale", "plane_ramp")


def build_parser() -> argparse.ArgumentParser:
    from omniscale.tools import balance_cli, data_cli, model_cli, plane_cli

    parser = argparse.ArgumentParser(prog="omniscale", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    data_cli.add_commands(commands)
    balance_cli.add_commands(commands)
    _add_train(commands)
    _add_report(commands)
    _add_bench(commands)
    plane_cli.add_commands(commands)
    model_cli.add_commands(commands)
    return parser


def _add_train(commands) -> None:
    train = commands.add_parser(
        "train", help="train a model: embedded plane, loaders, FSDP ranks, checkpoints, eval")
    train.add_argument("config", nargs="?", metavar="CONFIG.yaml",
                       help="run config (optional with --resume: the run's own config.yaml)")
    train.add_argument("--nproc", type=int, default=1,
                       help="processes on this machine (1: in this process)")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue RUN_DIR from its latest checkpoint; `auto`: the "
                            "config's output_dir if it holds a checkpoint, else a fresh start "
                            "(what a requeued job runs)")
    train.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a config key (dotted, YAML value); repeatable")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--plane", metavar="URL", help="an external data plane (`omniscale "
                       "plane serve --dp NPROC --sp-max 1 ...`) instead of the embedded one")
    train.add_argument("--ray-address", metavar="ADDRESS",
                       help="decode on the Ray cluster at ADDRESS (`auto`: the one running "
                       "here): data.loader=ray, data.ray_address=ADDRESS")
    from omniscale.tools.plane_cli import add_tls_root_argument, add_token_arguments

    add_token_arguments(train)  # --token-file, --token (else $OMNISCALE_PLANE_TOKEN)
    add_tls_root_argument(train)
    train.set_defaults(func=_train)


def _add_report(commands) -> None:
    report = commands.add_parser(
        "report", help="plots of a training run (loss, throughput, mixture, load) + index.html")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (metrics.jsonl)")
    report.add_argument("--out", metavar="DIR", help="output directory (default RUN_DIR/report)")
    report.set_defaults(func=_report)


def _add_bench(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks against their baselines")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True,
                                          metavar="SUBCOMMAND")
    bench_all = bench_commands.add_parser(
        "all", help="run every tools/bench benchmark; JSON + Markdown table of headline ratios")
    # Arguments here, not imported from tools/bench/all.py: tools/bench is not a package that
    # an installed (non-editable) distribution carries, and --help must work without it.
    bench_all.add_argument("--quick", action="store_true",
                           help="each bench's quick mode (or smaller sizes where it has none)")
    bench_all.add_argument("--only", metavar="NAME,...",
                           help=f"run only these ({', '.join(BENCH_NAMES)})")
    bench_all.add_argument("--write-docs", action="store_true",
                           help="write each bench's committed JSON under docs/bench (full "
                                "sizes, a clean tree; the docs' tables are then regenerated "
                                "from them)")
    bench_all.add_argument("--out", default="bench-results.json", metavar="FILE",
                           help="collected JSON (default bench-results.json); the Markdown "
                                "table goes beside it as .md")
    bench_all.set_defaults(func=_bench_all)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"omniscale: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("omniscale: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
