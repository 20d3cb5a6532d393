"""Commit benchmark: the time for every rank of a 256-rank job to commit one step to the plane,
with the plane's group commit, against the same plane fsyncing each record under its lock.

    .venv/bin/python tools/bench/commit.py --out docs/bench/commit.json

Each rank's commit must be durable before it is acknowledged (a restarted plane must not
forget it). Before group commit the plane fsynced each record under its lock, so a step's
commits queued one fsync each: the baseline is exactly that (a second plane whose log appends
are forced to sync, in the same run). In both, 256 client threads commit the step through
`DataPlane.commit` together; with group commit the records written while one fsync runs share
the next. Measured on this machine's disk (``--fsync-ms 0``) and on a simulated slower one
(each fsync made longer by ``--fsync-ms``, as on network or cloud block storage, where a
few ms per fsync is common).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from omniscale.dataplane import journal as journal_module  # noqa: E402
from omniscale.dataplane.plane import DataPlane, PlaneConfig  # noqa: E402
from omniscale.plan import fingerprint  # noqa: E402
from omniscale.tools.bench.plane_data import write_sources, write_spec  # noqa: E402
from omniscale.tools.bench.provenance import provenance  # noqa: E402


def with_fsync_delay(ms: float):
    """os.fsync as the journal sees it, made `ms` slower (0: the real one)."""
    real = os.fsync

    def fsync(fd):
        time.sleep(ms / 1e3)
        real(fd)
    journal_module.os.fsync = fsync if ms else real
    return real


def commit_step(plane: DataPlane, step: int, ranks: int) -> tuple[float, int]:
    """Seconds for every rank to commit `step` from its own thread, and the fsyncs taken."""
    prints = [fingerprint(plane.get_plan(step, r)) for r in range(ranks)]
    start, fsyncs = threading.Barrier(ranks + 1), plane.journal.fsyncs
    threads = [threading.Thread(target=lambda r=r: (start.wait(),
                                                    plane.commit(step, r, prints[r])))
               for r in range(ranks)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, plane.journal.fsyncs - fsyncs


def fsync_each_record(plane: DataPlane) -> DataPlane:
    """The plane as it was before group commit: every log append fsyncs, under its lock."""
    append = plane.journal.append
    plane.journal.append = lambda record, sync=True: append(record, sync=True)
    return plane


def measure(spec: Path, tmp: Path, ranks: int, steps: int, fsync_ms: float) -> dict:
    config = PlaneConfig(dp=ranks, window=4, global_batch_samples=2 * ranks,
                         micro_batch_tokens=16384, plan_ahead=0)
    plane = DataPlane(spec, tmp / f"state-{fsync_ms}", config)
    baseline = fsync_each_record(DataPlane(spec, tmp / f"serial-{fsync_ms}", config))
    real = with_fsync_delay(fsync_ms)
    try:
        grouped, fsyncs, serial = [], [], []
        for step in range(steps):  # alternating, so drift hits both alike
            seconds, n = commit_step(plane, step, ranks)
            grouped.append(seconds)
            fsyncs.append(n)
            serial.append(commit_step(baseline, step, ranks)[0])
    finally:
        journal_module.os.fsync = real
    row = {"fsync_extra_ms": fsync_ms, "ranks": ranks, "steps": steps,
           "group_commit_s": statistics.median(grouped),
           "fsyncs_per_step": statistics.median(fsyncs),
           "fsync_each_s": statistics.median(serial)}
    row["speedup"] = row["fsync_each_s"] / row["group_commit_s"]
    print(f"fsync +{fsync_ms:g} ms: {ranks} rank commits of a step {row['group_commit_s']:.3f} s "
          f"with group commit ({row['fsyncs_per_step']:g} fsyncs) vs "
          f"{row['fsync_each_s']:.3f} s fsyncing each record: {row['speedup']:.1f}x",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="steps measured (median reported)")
    ap.add_argument("--fsync-ms", default="0,5",
                    help="extra ms per fsync, comma-separated (0: this disk as it is)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    source = provenance()  # before the run: the load it started under
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None
                                     ) as d:
        tmp = Path(d)  # on the repository's disk when runs/ exists (not a tmpfs)
        names = write_sources(tmp / "src", 20, 4, 500)
        spec = write_spec(tmp / "src" / "spec.yaml", names)
        rows = [measure(spec, tmp, args.ranks, args.steps, float(ms))
                for ms in args.fsync_ms.split(",")]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": "tools/bench/commit.py " + " ".join(sys.argv[1:] if argv is None
                                                           else argv),
            "provenance": source, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
