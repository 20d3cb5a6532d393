"""``omniscale data …``: demo data, source indexes, conversation import, spec inspection and
copies into object stores. Each subcommand: its arguments (``_add_*``) and its handler."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omniscale.errors import UserError

EXIT_CORRUPT = 3  # index written, but some members were corrupt and are marked in it
MAX_SKIP_LINES = 100  # `data import` lists the rest in OUT/_skipped.jsonl only


def add_commands(commands) -> None:
    data = commands.add_parser("data", help="demo data, source indexes, mixing specs")
    subcommands = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    for add in (_add_demo, _add_index, _add_import, _add_inspect, _add_copy):
        add(subcommands)


def _add_demo(subcommands) -> None:
    """``data demo OUT``"""
    demo = subcommands.add_parser("demo", help="generate the demo omni dataset")
    demo.add_argument("out", help="output directory")
    demo.add_argument("--scale", choices=("tiny", "small", "medium"), default="tiny")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    demo.set_defaults(func=_data_demo)


def _add_index(subcommands) -> None:
    """``data index PATH…``"""
    index = subcommands.add_parser(
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


def _add_import(subcommands) -> None:
    """``data import FORMAT SRC… --out DIR``"""
    imp = subcommands.add_parser(
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


def _add_inspect(subcommands) -> None:
    """``data inspect SPEC``"""
    inspect = subcommands.add_parser(
        "inspect", help="per-source counts, length percentiles and the schedule's weights")
    inspect.add_argument("spec", help="mixing spec (YAML)")
    inspect.add_argument("--plot", metavar="FILE.png", help="draw length histograms and schedule")
    inspect.add_argument("--steps", help="comma-separated steps (or tokens) to show weights at")
    inspect.set_defaults(func=_data_inspect)


def _add_copy(subcommands) -> None:
    """``data copy SPEC… --to URL``"""
    copy = subcommands.add_parser(
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
