"""The ``omniscale`` command line.

Every subcommand turns a :class:`omniscale.errors.UserError` into one line on stderr and a
non-zero exit; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omniscale.errors import UserError

EXIT_USER_ERROR = 2
EXIT_CORRUPT = 3  # index written, but some members were corrupt and are marked in it
MAX_SKIP_LINES = 100  # `data import` lists the rest in OUT/_skipped.jsonl only


def _data_demo(args: argparse.Namespace) -> int:
    from omniscale.tools.demo import generate

    generate(Path(args.out), scale=args.scale, seed=args.seed, workers=args.workers)
    return 0


def _data_index(args: argparse.Namespace) -> int:
    from omniscale.loaders.index import index_paths
    from omniscale.location import check_storage_options

    options = None
    if args.storage_options is not None:
        try:
            options = json.loads(args.storage_options)
        except ValueError as e:
            raise UserError(f"--storage-options: not JSON ({e})") from None
        options = check_storage_options(options, "--storage-options")
    reports = index_paths(args.paths, tokenizer=args.tokenizer, workers=args.workers,
                          force=args.force, index_dir=args.index_dir,
                          storage_options=options, ray=args.ray)
    corrupt = sum(r.corrupt for r in reports)
    for report in reports:
        for line in report.errors:
            print(line, file=sys.stderr)
    if corrupt and not args.allow_corrupt:
        print(f"omniscale: {corrupt} corrupt member(s) marked in the index and skipped "
              "(--allow-corrupt exits 0)", file=sys.stderr)
        return EXIT_CORRUPT
    return 0


def _data_import(args: argparse.Namespace) -> int:
    from omniscale.loaders.importers import import_conversations

    report = import_conversations(args.format, args.src, args.out, media_root=args.media_root,
                                  samples_per_shard=args.samples_per_shard,
                                  workers=args.workers, force=args.force,
                                  progress=not args.no_progress)
    lines = report.lines()
    for line in lines[:MAX_SKIP_LINES]:
        print(line, file=sys.stderr)
    if len(lines) > MAX_SKIP_LINES:
        print(f"... and {len(lines) - MAX_SKIP_LINES} more skipped record(s)", file=sys.stderr)
    print(report.summary())
    if report.skipped and not args.allow_skipped:
        print(f"omniscale: {len(report.skipped)} record(s) skipped (--allow-skipped exits 0)",
              file=sys.stderr)
        return EXIT_CORRUPT
    return 0


def _data_copy(args: argparse.Namespace) -> int:
    from omniscale.tools.data_copy import copy_specs

    for out in copy_specs(args.specs, args.to, args.storage_options, args.suffix,
                          out_dir=args.out_dir):
        print(out)
    return 0


def _data_inspect(args: argparse.Namespace) -> int:
    from omniscale.tools.mix_report import inspect_spec

    steps = None
    if args.steps:
        try:
            steps = [float(s) for s in args.steps.split(",")]
        except ValueError:
            raise UserError(f"--steps: expected comma-separated numbers, "
                            f"got {args.steps!r}") from None
    inspect_spec(Path(args.spec), plot=Path(args.plot) if args.plot else None, steps=steps)
    return 0


def _report(args: argparse.Namespace) -> int:
    from omniscale.tools.report import report_command

    return report_command(args.run_dir, args.out)


def _bench_all(args: argparse.Namespace) -> int:
    from omniscale.tools.bench.all import run_all, select

    return run_all(select(args.only), args.quick, Path(args.out))


def _balance_simulate(args: argparse.Namespace) -> int:
    from omniscale.tools.balance_sim import simulate_command

    simulate_command(args)
    return 0


def _balance_calibrate(args: argparse.Namespace) -> int:
    from omniscale.tools.balance_calibrate import calibrate, summary
    from omniscale.tools.bench.provenance import provenance

    started = provenance()  # commit and load: whoever reads the figures can weigh them
    result = calibrate(args.config, args.set or [], repeats=args.repeats,
                       held_out=args.held_out, progress=lambda line: print(line, flush=True),
                       nproc=args.nproc)
    result = {"command": " ".join(["omniscale", *sys.argv[1:]]), **started, **result}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    print(f"wrote {args.out} (data.costs / plane serve --costs)")
    return 0


def _train(args: argparse.Namespace) -> int:
    import os

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
               "commit", "loader", "ray_loader", "remote", "plane", "e2e", "gpu_check")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniscale", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    data = commands.add_parser("data", help="demo data, source indexes, mixing specs")
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")

    demo = data_commands.add_parser("demo", help="generate the demo omni dataset")
    demo.add_argument("out", help="output directory")
    demo.add_argument("--scale", choices=("tiny", "small", "medium"), default="tiny")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    demo.set_defaults(func=_data_demo)

    index = data_commands.add_parser(
        "index", help="write each source's Parquet index (cost features from headers only)")
    index.add_argument("paths", nargs="+", metavar="PATH",
                       help="a mixing spec (indexes all its sources), a source directory or "
                            "a source URL (s3://bucket/prefix, gs://…: read in place, by "
                            "ranged reads of its headers)")
    index.add_argument("--tokenizer", type=Path, default=None,
                       help="tokenizer.json (default: the spec's, or the nearest one above "
                            "the source directory)")
    index.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    index.add_argument("--force", action="store_true", help="re-index unchanged shards too")
    index.add_argument("--allow-corrupt", action="store_true",
                       help="exit 0 even when corrupt members were found (they stay marked)")
    index.add_argument("--index-dir", metavar="DIR",
                       help="write source NAME's index to DIR/NAME/_index.parquet (a local "
                            "directory or URL; for a read-only bucket); with a spec, the "
                            "spec's index_dir must say the same")
    index.add_argument("--storage-options", metavar="JSON",
                       help="fsspec options of URL paths, e.g. '{\"endpoint_url\": "
                            "\"http://minio:9000\"}' (credentials from the environment)")
    index.add_argument("--ray", nargs="?", const=True, default=None, metavar="ADDRESS",
                       help="index the shards as a Ray Data pipeline: on a local Ray instance, "
                            "or the cluster at ADDRESS (auto: the one running here); put it "
                            "after the paths")
    index.set_defaults(func=_data_index)

    imp = data_commands.add_parser(
        "import", help="convert conversation datasets (openai, sharegpt, llava) into a "
                       "WebDataset source")
    imp.add_argument("format", metavar="FORMAT", help="openai, sharegpt or llava")
    imp.add_argument("src", nargs="+", metavar="SRC",
                     help="*.json / *.jsonl input files, or directories holding them")
    imp.add_argument("--out", required=True, metavar="DIR",
                     help="output directory: DIR/*.tar shards, DIR/_skipped.jsonl")
    imp.add_argument("--media-root", metavar="DIR",
                     help="where relative media paths point (default: beside each input file)")
    imp.add_argument("--samples-per-shard", type=int, default=1000, metavar="N",
                     help="samples per tar shard (default 1000)")
    imp.add_argument("--workers", type=int, default=None, metavar="N",
                     help="processes (default: one per input file, at most all cores)")
    imp.add_argument("--force", action="store_true",
                     help="discard DIR's shards and convert every input file again")
    imp.add_argument("--allow-skipped", action="store_true",
                     help="exit 0 even when records were skipped (they stay listed)")
    imp.add_argument("--no-progress", action="store_true", help="no progress bar")
    imp.set_defaults(func=_data_import)

    inspect = data_commands.add_parser(
        "inspect", help="per-source counts, length percentiles and the schedule's weights")
    inspect.add_argument("spec", help="mixing spec (YAML)")
    inspect.add_argument("--plot", metavar="FILE.png", help="draw length histograms and schedule")
    inspect.add_argument("--steps", help="comma-separated steps (or tokens) to show weights at")
    inspect.set_defaults(func=_data_inspect)

    copy = data_commands.add_parser(
        "copy", help="put specs' sources (shards + indexes) into an object store and write "
                     "the specs that read them there")
    copy.add_argument("specs", nargs="+", metavar="SPEC", help="mixing specs (YAML)")
    copy.add_argument("--to", required=True, metavar="URL", help="s3://bucket/prefix (each "
                      "source goes to URL/<name>/)")
    copy.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                      help='fsspec options for URL, e.g. \'{"endpoint_url": "http://…"}\' '
                           "(no credentials: they come from the environment)")
    copy.add_argument("--suffix", default="_remote",
                      help="the rewritten spec is SPEC<suffix>.yaml (default _remote)")
    copy.add_argument("--out-dir", type=Path, default=None,
                      help="where the rewritten specs go (default: beside each spec)")
    copy.set_defaults(func=_data_copy)

    balance = commands.add_parser("balance", help="compute-aware placement of samples on ranks")
    balance_commands = balance.add_subparsers(dest="balance_command", required=True,
                                              metavar="SUBCOMMAND")
    sim = balance_commands.add_parser(
        "simulate", help="our planner against baselines on the same global batches")
    source = sim.add_argument_group("samples (exactly one)")
    source.add_argument("--lengths", metavar="FILE",
                        help="Parquet or JSONL with llm_tokens (and encoder_patches), or a "
                             "source index (_index.parquet)")
    source.add_argument("--dist", metavar="NAME",
                        help="built-in generator: lognormal, omni, uniform, bimodal")
    sim.add_argument("--dp", type=int, default=8, help="data-parallel ranks (default 8)")
    sim.add_argument("--window", type=int, default=4,
                     help="global batches planned together (default 4)")
    sim.add_argument("--micro-batch-tokens", type=int, default=16384,
                     help="hard per-rank micro-batch token budget (default 16384)")
    sim.add_argument("--cost-linear", type=float, default=24576.0,
                     help="alpha in alpha*L + beta*L^2 (default 24576)")
    sim.add_argument("--cost-quadratic", type=float, default=1.0,
                     help="beta in alpha*L + beta*L^2 (default 1)")
    sim.add_argument("--sp-max", type=int, default=8,
                     help="largest sequence-parallel group, a power of two (default 8)")
    sim.add_argument("--steps", type=int, default=None,
                     help="global batches to plan (default: 16 with --dist, all with --lengths)")
    comm = sim.add_argument_group(
        "communication (SP all-to-all, encoder reshard), charged to every policy")
    comm.add_argument("--bandwidth", type=float, default=25.0, metavar="GB/s",
                      help="all-to-all bandwidth per rank in GB/s (default 25; inf: free)")
    comm.add_argument("--hidden-size", type=int, default=4096,
                      help="model hidden size: bytes per token (default 4096)")
    comm.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    comm.add_argument("--dtype-bytes", type=int, default=2,
                      help="bytes per activation value (default 2, bf16)")
    comm.add_argument("--unit-seconds", type=float, default=6 * 32 * 4096 / 400e12,
                      help="seconds one cost unit takes (default 1.966e-9: 6*32*4096 FLOPs, "
                           "the default cost's L^2 term for this shape, at 400 TFLOP/s)")
    batch = sim.add_argument_group("global batch (at most one; default 8 samples per rank)")
    batch.add_argument("--samples-per-rank", type=int, default=None)
    batch.add_argument("--global-batch-tokens", type=int, default=None,
                       help="greedy global batches of at most this many tokens")
    sim.add_argument("--epsilon", type=float, default=0.05,
                     help="per-step token and mixture tolerance (default 0.05)")
    sim.add_argument("--seed", type=int, default=0, help="generator seed for --dist")
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.add_argument("--plot", metavar="FILE.png", help="draw per-rank load per step per policy")
    sim.add_argument("--plan-out", metavar="FILE.parquet",
                     help="write our plan: one row per placement")
    sim.set_defaults(func=_balance_simulate)
    cal = balance_commands.add_parser(
        "calibrate", help="time the run's model here and fit the balancer's cost model")
    cal.add_argument("config", metavar="CONFIG.yaml", help="the run config (model and data)")
    cal.add_argument("--out", default="costs.json", help="cost file to write (costs.json)")
    cal.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override a config field, as for train")
    cal.add_argument("--repeats", type=int, default=3,
                     help="timed runs per measurement, the median kept (default 3)")
    cal.add_argument("--held-out", type=int, default=12,
                     help="random mixes timed apart from the fit, to score it (default 12)")
    cal.add_argument("--nproc", type=int, default=1,
                     help="ranks the run puts on this machine: on CPU each measurement gets "
                          "the threads one of them gets (default 1)")
    cal.set_defaults(func=_balance_calibrate)
    train = commands.add_parser(
        "train", help="train a model: embedded plane, loaders, FSDP ranks, checkpoints, eval")
    train.add_argument("config", nargs="?", metavar="CONFIG.yaml",
                       help="run config (optional with --resume: the run's own config.yaml)")
    train.add_argument("--nproc", type=int, default=1,
                       help="processes on this machine (1: in this process)")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue RUN_DIR from its latest checkpoint")
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

    report = commands.add_parser(
        "report", help="plots of a training run (loss, throughput, mixture, load) + index.html")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (metrics.jsonl)")
    report.add_argument("--out", metavar="DIR", help="output directory (default RUN_DIR/report)")
    report.set_defaults(func=_report)

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
    bench_all.add_argument("--out", default="bench-results.json", metavar="FILE",
                           help="collected JSON (default bench-results.json); the Markdown "
                                "table goes beside it as .md")
    bench_all.set_defaults(func=_bench_all)

    from omniscale.tools.plane_cli import add_commands as add_plane_commands

    add_plane_commands(commands)
    from omniscale.tools.model_cli import add_commands as add_model_commands

    add_model_commands(commands)
    return parser


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
