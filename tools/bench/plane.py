"""Data-plane benchmark: memory against replicated per-rank state, serving rate, planning rate.

    .venv/bin/python tools/bench/plane.py [--quick | --full] [--out bench-plane.json]

Memory. Synthetic sources (tools/bench/plane_data.py): 1,000 sources x 10 shards x 1,000
samples by default, 100 shards with ``--full`` (the issue's scale), 100 x 10 x 1,000 with
``--quick``. Measured: the RSS of ``omniscale plane serve`` for 64 ranks after it has planned
ahead and served every rank's plans, plus the RSS of a trainer-side process holding a
PlaneClient that fetched its plans (whole processes: interpreter and pyarrow included).
Baseline: what per-rank loaders replicate -- every source's reader state and the index slice
it reads from (the same per-source state the plane's catalog holds, opened in every source) --
measured once as the RSS growth of a process that builds it, times 64 ranks x 4 workers.

Serving. A plane for 256 ranks; 256 clients (4 processes x 64 threads, one PlaneClient each)
fetch their rank's plans of already-planned steps for a fixed time: fetches/s, p50/p99 latency.
Clients and plane share the machine's cores. Three runs: closed loop with the default per-call
``plan`` action (the baseline), closed loop over the plan stream (``PlaneClient(stream=True)``),
and the stream paced at 4 fetches/s per client (a 256-rank job at 4 steps/s) for the latency a
job sees at a realistic load.

Planning. The plane's own draw + plan + per-rank tables for a 1,024-rank job, 8 samples per
rank per step, window 4: windows (and steps) per second against the one step per second the
job consumes.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from tools.bench.plane_data import write_sources, write_spec  # noqa: E402

RANKS, WORKERS = 64, 4
SERVE_RANKS, PROCS = 256, 4
SCALES = {"quick": (100, 10, 1000), "default": (1000, 10, 1000), "full": (1000, 100, 1000)}
TARGETS = {"memory_ratio": 20.0, "fetches_per_s": 5000.0, "p99_ms": 20.0, "steps_per_s": 1.0}


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size from /proc (no psutil needed)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


class Child:
    """A child process whose stdout lines arrive on a queue (block with a timeout)."""

    def __init__(self, args: list[str], stdin: bool = False):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.popen = subprocess.Popen(args, cwd=ROOT, env=env, text=True,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def line(self, timeout: float = 600) -> str:
        line = self.lines.get(timeout=timeout)
        if line is None:
            raise RuntimeError(f"{self.popen.args[:4]} exited ({self.popen.wait()})")
        return line

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
        self.popen.wait(timeout=60)


def serve(spec: Path, state: Path, dp: int, batch: int) -> tuple[Child, str]:
    plane = Child([sys.executable, "-m", "tools.cli", "plane", "serve", "--spec", str(spec),
                   "--state-dir", str(state), "--dp", str(dp), "--global-batch-samples",
                   str(batch), "--micro-batch-tokens", "16384", "--window", "4"])
    while "serving" not in (line := plane.line()):
        pass
    return plane, line.split()[3]


def self_command(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


# -- roles run in child processes -----------------------------------------------------------
def replica_role(spec: str) -> None:
    """One per-rank loader's replicated state: every source's reader state and index slice."""
    from dataplane.catalog import Catalog
    from dataplane.spec import load_spec

    loaded = load_spec(spec)
    before = rss_bytes()
    catalog = Catalog.from_spec(loaded)
    for source in catalog:
        source.peek()  # opens the shard the cursor is in: its index slice
    print(json.dumps({"replica_bytes": rss_bytes() - before, "sources": len(catalog)}),
          flush=True)


def client_role(url: str, rank: int) -> None:
    """A trainer-side client: fetch this rank's plans of a window, report the process RSS."""
    from dataplane.client import PlaneClient

    with PlaneClient(url) as client:
        rows = sum(client.get_plan(step, rank).num_rows for step in range(4))
        print(json.dumps({"client_bytes": rss_bytes(), "rows": rows}), flush=True)


def fetch_role(url: str, first_rank: int, threads: int, seconds: float, mode: str = "action",
               rate: float = 0.0) -> None:
    """``threads`` clients (ranks first_rank…) fetching plans of steps 0-7 after a "go" line:
    back to back (``rate`` 0: closed loop), or each at ``rate`` fetches/s on a fixed schedule
    (open loop: a late fetch does not delay the next one's start time, and its latency
    counts from when it was due). ``mode``: ``action`` (a Flight call per fetch, PlaneClient's
    default) or ``stream`` (PlaneClient(stream=True))."""
    import numpy as np

    from dataplane.client import PlaneClient

    clients = [PlaneClient(url, stream=mode == "stream") for _ in range(threads)]
    for t, client in enumerate(clients):
        client.get_plan(0, first_rank + t)  # connected and warm
    print("ready", flush=True)
    sys.stdin.readline()
    latencies: list[list[float]] = [[] for _ in range(threads)]
    deadline = time.perf_counter() + seconds

    def run(t: int) -> None:
        client, out, step = clients[t], latencies[t], t % 8
        if rate <= 0:
            while (start := time.perf_counter()) < deadline:
                client.get_plan(step, first_rank + t)
                out.append(time.perf_counter() - start)
                step = (step + 1) % 8
            return
        period = 1.0 / rate
        due = time.perf_counter() + period * (t / threads)  # spread the clients' phases
        while due < deadline:
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
            client.get_plan(step, first_rank + t)
            out.append(time.perf_counter() - due)
            step = (step + 1) % 8
            due += period

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    lat = np.concatenate([np.array(x) for x in latencies])
    print(json.dumps({"fetches": len(lat), "latencies_ms": (lat * 1e3).round(3).tolist()}),
          flush=True)


# -- the three measurements ----------------------------------------------------------------
def memory(spec: Path, tmp: Path) -> dict:
    plane, url = serve(spec, tmp / "state-memory", RANKS, RANKS * 16)
    try:
        from dataplane.client import PlaneClient

        with PlaneClient(url) as client:  # every rank's plans served: the plane's tables exist
            for step in range(4):
                for rank in range(RANKS):
                    client.get_plan(step, rank)
        trainer = Child(self_command("--role", "client", url, "0"))
        client_bytes = json.loads(trainer.line())["client_bytes"]
        plane_bytes = rss_bytes(plane.popen.pid)
    finally:
        plane.stop()
    replica = json.loads(Child(self_command("--role", "replica", str(spec))).line())
    replicated = replica["replica_bytes"] * RANKS * WORKERS
    ours = plane_bytes + client_bytes
    return {"plane_bytes": plane_bytes, "client_bytes": client_bytes,
            "replica_bytes": replica["replica_bytes"], "replicas": RANKS * WORKERS,
            "replicated_bytes": replicated, "ratio": replicated / ours}


def serving(spec: Path, tmp: Path, clients: int, seconds: float, mode: str = "stream",
            rate: float = 0.0) -> dict:
    """``clients`` clients in PROCS processes; closed loop (``rate`` 0) or each paced at
    ``rate`` fetches/s. ``mode``: the client's transport (see fetch_role)."""
    import numpy as np

    plane, url = serve(spec, tmp / f"state-serving-{mode}-{rate:g}", clients, clients * 8)
    per = clients // PROCS
    try:
        workers = [Child(self_command("--role", "fetch", url, str(p * per), str(per),
                                      str(seconds), mode, str(rate)), stdin=True)
                   for p in range(PROCS)]
        for worker in workers:
            assert worker.line().strip() == "ready"
        start = time.perf_counter()
        for worker in workers:
            worker.popen.stdin.write("go\n")
            worker.popen.stdin.flush()
        results = [json.loads(worker.line()) for worker in workers]
        wall = time.perf_counter() - start
    finally:
        plane.stop()
    lat = np.concatenate([np.array(r["latencies_ms"]) for r in results])
    fetches = sum(r["fetches"] for r in results)
    return {"clients": clients, "processes": PROCS, "mode": mode, "rate_per_client": rate,
            "seconds": seconds, "fetches": fetches,
            "fetches_per_s": fetches / seconds, "wall_s": wall,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99))}


def planning(spec: Path, tmp: Path, windows: int) -> dict:
    from dataplane.plane import DataPlane, PlaneConfig

    dp, W = 1024, 4
    config = PlaneConfig(dp=dp, window=W, global_batch_samples=8 * dp, micro_batch_tokens=16384,
                         plan_ahead=0)
    plane = DataPlane(spec, tmp / "state-planning", config)  # plans window 0 (warms numba)
    start = time.perf_counter()
    first = plane.next_window
    for k in range(first, first + windows):
        plane._draw_window(k)
    planned = time.perf_counter() - start
    for k in range(first, first + windows):
        for step in range(k * W, (k + 1) * W):
            plane._table(step, 0)  # builds every rank's table of the step
    total = time.perf_counter() - start
    return {"dp": dp, "samples_per_step": 8 * dp, "window": W, "windows": windows,
            "plan_s_per_window": planned / windows, "total_s_per_window": total / windows,
            "windows_per_s": windows / total, "steps_per_s": windows * W / total}


# -- report ---------------------------------------------------------------------------------
def report(out: dict) -> list[dict]:
    mem, srv, pln = out["memory"], out["serving"], out["planning"]
    act, paced = out["serving_action"], out["serving_paced"]
    mib = 2 ** 20
    return [
        {"what": "memory: replicated / (plane + client)",
         "baseline": f"{mem['replicated_bytes'] / mib:,.0f} MiB "
                     f"({mem['replica_bytes'] / mib:.1f} MiB x {mem['replicas']})",
         "measured": f"{(mem['plane_bytes'] + mem['client_bytes']) / mib:,.0f} MiB "
                     f"(plane {mem['plane_bytes'] / mib:.0f} + client "
                     f"{mem['client_bytes'] / mib:.0f})",
         "value": f"{mem['ratio']:.1f}x", "target": ">= 20x",
         "met": mem["ratio"] >= TARGETS["memory_ratio"]},
        {"what": f"serving: fetches/s, {srv['clients']} clients ({PROCS} processes), stream",
         "baseline": f"{act['fetches_per_s']:,.0f}/s per-call actions (p50 "
                     f"{act['p50_ms']:.0f} ms, p99 {act['p99_ms']:.0f} ms)",
         "measured": f"{srv['fetches']:,} in {srv['seconds']:g} s",
         "value": f"{srv['fetches_per_s']:,.0f}/s", "target": ">= 5,000/s",
         "met": srv["fetches_per_s"] >= TARGETS["fetches_per_s"]},
        {"what": "serving: latency p50 / p99", "baseline": "-",
         "measured": f"p50 {srv['p50_ms']:.2f} ms", "value": f"{srv['p99_ms']:.2f} ms",
         "target": "p99 <= 20 ms", "met": srv["p99_ms"] <= TARGETS["p99_ms"]},
        {"what": f"serving paced: {paced['clients']} clients x {paced['rate_per_client']:g}/s",
         "baseline": "-", "measured": f"{paced['fetches_per_s']:,.0f}/s, p50 "
                                      f"{paced['p50_ms']:.2f} ms",
         "value": f"p99 {paced['p99_ms']:.2f} ms", "target": "(information)", "met": True},
        {"what": f"planning: {pln['dp']} ranks, {pln['samples_per_step']} samples/step",
         "baseline": "1 step/s consumed",
         "measured": f"{pln['total_s_per_window'] * 1e3:.0f} ms/window "
                     f"(plan {pln['plan_s_per_window'] * 1e3:.0f})",
         "value": f"{pln['steps_per_s']:.1f} steps/s", "target": ">= 1 step/s",
         "met": pln["steps_per_s"] >= TARGETS["steps_per_s"]},
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="100 sources, short runs")
    size.add_argument("--full", action="store_true", help="1,000 x 100 x 1,000 samples")
    parser.add_argument("--out", default="bench-plane.json", help="JSON output path")
    parser.add_argument("--data", help="keep the synthetic sources here (reused if present)")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)  # child processes
    args = parser.parse_args(argv)
    if args.role:
        role, *rest = args.role
        {"replica": lambda: replica_role(*rest),
         "client": lambda: client_role(rest[0], int(rest[1])),
         "fetch": lambda: fetch_role(rest[0], int(rest[1]), int(rest[2]), float(rest[3]),
                                     *rest[4:5], *map(float, rest[5:6]))}[role]()
        return 0
    scale = "quick" if args.quick else "full" if args.full else "default"
    sources, shards, per_shard = SCALES[scale]
    with tempfile.TemporaryDirectory(prefix="bench-plane-") as tmp_name:
        tmp = Path(tmp_name)
        data = Path(args.data) if args.data else tmp / "sources"
        start = time.perf_counter()
        names = write_sources(data / f"{sources}x{shards}x{per_shard}", sources, shards,
                              per_shard)
        root = data / f"{sources}x{shards}x{per_shard}"
        spec = write_spec(root / "mix.yaml", names)
        small = write_spec(root / "mix-small.yaml", names[:100])
        print(f"sources: {sources} x {shards} shards x {per_shard} samples "
              f"({time.perf_counter() - start:.0f} s to write)", flush=True)
        out = {"scale": {"sources": sources, "shards": shards, "per_shard": per_shard},
               "command": " ".join(["tools/bench/plane.py"] + (argv or sys.argv[1:]))}
        out["memory"] = memory(spec, tmp)
        seconds = 3.0 if args.quick else 10.0
        out["serving_action"] = serving(small, tmp, SERVE_RANKS, seconds, "action")
        out["serving"] = serving(small, tmp, SERVE_RANKS, seconds, "stream")
        # Paced: every rank fetching 4 plans/s (a job at 4 steps/s), latency at that load.
        out["serving_paced"] = serving(small, tmp, SERVE_RANKS, seconds, "stream", 4.0)
        out["planning"] = planning(small, tmp, 2 if args.quick else 5)
    out["rows"] = report(out)
    print_table(out["rows"])
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0 if all(r["met"] for r in out["rows"]) else 1


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="data plane: measured vs target (baselines measured in the same run)")
    for col in ("what", "baseline", "measured", "value", "target", "met"):
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row[c]) if c != "met" else ("yes" if row[c] else "NO")
                        for c in ("what", "baseline", "measured", "value", "target", "met")))
    Console(width=160).print(table)


if __name__ == "__main__":
    sys.exit(main())
