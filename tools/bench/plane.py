"""Data-plane benchmark: memory against replicated per-rank state, serving rate, planning rate.

    .venv/bin/python tools/bench/plane.py [--quick | --full] [--out bench-plane.json]
    .venv/bin/python tools/bench/plane.py --serving-only [--seconds 10] [--rate 5000]
    .venv/bin/python tools/bench/plane.py --planning-only [--plan-ranks 1024,4096,16384]

Memory. Synthetic sources (tools/bench/plane_data.py): 1,000 sources x 10 shards x 1,000
samples by default, 100 shards with ``--full`` (the issue's scale), 100 x 10 x 1,000 with
``--quick``. A job of 64 ranks x 4 loader workers has 256 loader processes. Both sides are
measured as real processes, by PSS (shared pages split between the processes sharing them), at
1, 2, 4 and 8 processes (``--memory-procs``), and extrapolated to 256 by a straight line fitted
to each side's totals (least squares): ours is ``omniscale plane serve`` for 64 ranks (after it
planned ahead and served every rank's plans) plus K trainer-side processes each holding a
PlaneClient that fetched its plans; the baseline is K per-rank loader processes each holding
every source's state the way per-rank loaders do (every source's reader state and the index
slice its cursor reads, opened: the plane catalog's per-source state, in every process). Whole
processes on both sides, interpreter and pyarrow included: the figure is what a job's loader
processes cost in total, not only the state. The fit and its extrapolation are reported with
the measured points. The measured peer (``--no-peer`` leaves it out): Megatron-Energon's
DataLoader workers over the same sources and shards as real tars, blended in one
MetadatasetV2, as ``tools/bench/plane_energon.py`` says -- what 256 of its workers add against
ours, and the state alone (a one-source loader's workers subtracted).

Serving. A plane for 256 ranks; 256 clients (4 processes x 64 threads, one PlaneClient each)
fetch their rank's plans of already-planned steps 0-7; every client first fetches each of its
8 plans once (connected, caches warm), then runs ``--warmup`` seconds unmeasured and
``--seconds`` measured. Clients and plane share the machine's cores. Transports: ``action``
(one Flight ``plan`` action per fetch: PlaneClient's default, the in-run baseline),
``exchange`` (the Flight do_exchange stream PlaneClient(stream=True) used before the plan lane)
and ``lane`` (PlaneClient(stream=True): the plan lane). Two loads:

- closed loop: every client fetches back to back -- the throughput target (>= 5,000/s). Its
  latency is information only: by Little's law 256 back-to-back clients at p99 <= 20 ms would
  need >= 12,800 fetches/s (mean latency = clients / rate).
- paced (open loop): every client fetches on a fixed schedule, 5,000 fetches/s in aggregate
  (``--rate``; 19.5/s per client, a 256-rank job at 19.5 steps/s); a late fetch does not delay
  the next one's due time and its latency counts from when it was due -- the latency target
  (p99 <= 20 ms at that load).

Each run also reports the CPU seconds per fetch of the plane process and of the client
processes (from /proc) and the 1-minute load average before it; ``load_avg_at_start`` (before
the first run, so without this benchmark's own threads) says whether other work shared the
cores, which makes latencies noisy.

Planning. The plane's own work for jobs of 1,024 and 4,096 ranks (``--full``: 16,384 too;
``--plan-ranks``), 8 samples per rank per step, window 4, by phase: draw, plan, the best
baseline's prediction, every rank's table, every rank's fingerprint (a whole-step commit
checks them): steps per second against the 2 steps/s a job consumes, and the plane's memory
at that size (RSS growth per window held). ``--planning-only`` runs this part alone;
``--plan-schedule const,tokens-ramp`` plans each size with equal weights and then with a
curriculum whose mixture moves at every token drawn (``docs/bench/plane_ramp.json``).
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

from omniscale.tools.bench.plane_data import write_sources, write_spec  # noqa: E402
from omniscale.tools.bench.plane_energon import pss_bytes  # noqa: E402
from omniscale.tools.bench.plane_report import (  # noqa: E402
    MODES,
    TARGETS,
    print_table,
    report,
)
from omniscale.tools.bench.provenance import provenance  # noqa: E402

RANKS, WORKERS = 64, 4
SERVE_RANKS, PROCS = 256, 4
SCALES = {"quick": (100, 10, 1000), "default": (1000, 10, 1000), "full": (1000, 100, 1000)}


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
    plane = Child([sys.executable, "-m", "omniscale", "plane", "serve", "--spec", str(spec),
                   "--state-dir", str(state), "--dp", str(dp), "--global-batch-samples",
                   str(batch), "--micro-batch-tokens", "16384", "--window", "4"])
    while "serving" not in (line := plane.line()):
        pass
    return plane, line.split()[3]


def self_command(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


# -- roles run in child processes -----------------------------------------------------------
def replica_role(spec: str) -> None:
    """A per-rank loader process: every source's reader state and index slice, held until
    stdin closes (the parent measures it meanwhile)."""
    from omniscale.dataplane.catalog import Catalog
    from omniscale.dataplane.spec import load_spec

    loaded = load_spec(spec)
    before = rss_bytes()
    catalog = Catalog.from_spec(loaded)
    for source in catalog:
        source.peek()  # opens the shard the cursor is in: its index slice
    print(json.dumps({"replica_bytes": rss_bytes() - before, "sources": len(catalog)}),
          flush=True)
    sys.stdin.read()


def client_role(url: str, rank: int) -> None:
    """A trainer-side process: fetch this rank's plans of a window and hold the client until
    stdin closes."""
    from omniscale.dataplane.client import PlaneClient

    with PlaneClient(url) as client:
        rows = sum(client.get_plan(step, rank).num_rows for step in range(4))
        print(json.dumps({"client_bytes": rss_bytes(), "rows": rows}), flush=True)
        sys.stdin.read()


def bare_role() -> None:
    """A loader process holding nothing: both sides' imports, no state (what every process of
    a job costs anyway)."""
    import omniscale.dataplane.catalog  # noqa: F401
    import omniscale.dataplane.client  # noqa: F401
    import omniscale.dataplane.spec  # noqa: F401

    print(json.dumps({"bare_bytes": rss_bytes()}), flush=True)
    sys.stdin.read()


def fetch_role(url: str, first_rank: int, threads: int, seconds: float, mode: str = "lane",
               rate: float = 0.0, warmup: float = 0.0) -> None:
    """``threads`` clients (ranks first_rank…) fetching plans of steps 0-7 after a "go" line,
    for ``warmup + seconds``; fetches that start (or are due) in the first ``warmup`` seconds
    are not reported. Back to back (``rate`` 0: closed loop), or each at ``rate`` fetches/s on
    a fixed schedule (open loop: a late fetch does not delay the next one's due time, and its
    latency counts from when it was due). ``mode``: ``action`` (a Flight call per fetch,
    PlaneClient's default), ``lane`` (PlaneClient(stream=True)) or ``exchange``
    (PlaneClient(stream=True) kept on the Flight do_exchange stream, as without a lane)."""
    import numpy as np

    from omniscale.dataplane.client import PlaneClient

    clients = [PlaneClient(url, stream=mode != "action") for _ in range(threads)]
    for t, client in enumerate(clients):
        if mode == "exchange":
            client._lane_port = 0  # as if the server had no lane
        for step in range(8):
            client.get_plan(step, first_rank + t)  # connected, request and plan caches warm
    print("ready", flush=True)
    sys.stdin.readline()
    latencies: list[list[float]] = [[] for _ in range(threads)]
    start = time.perf_counter()
    measured, deadline = start + warmup, start + warmup + seconds

    def run(t: int) -> None:
        client, out, step = clients[t], latencies[t], t % 8
        if rate <= 0:
            while (began := time.perf_counter()) < deadline:
                client.get_plan(step, first_rank + t)
                if began >= measured:
                    out.append(time.perf_counter() - began)
                step = (step + 1) % 8
            return
        period = 1.0 / rate
        due = start + period * ((first_rank + t) * 0.6180339887 % 1.0)  # phases spread evenly
        while due < deadline:
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
            client.get_plan(step, first_rank + t)
            if due >= measured:
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the three measurements ----------------------------------------------------------------
MEMORY_PROCS = (1, 2, 4, 8)  # processes measured on each side; extrapolated to RANKS * WORKERS


def _held(commands: list[list[str]]) -> tuple[list[Child], list[dict]]:
    """Start processes that report and then hold their state; wait for every report."""
    children = [Child(c, stdin=True) for c in commands]
    return children, [json.loads(c.line()) for c in children]


def _fit(points: dict[int, int], at: int) -> dict:
    import numpy as np

    k = np.array(sorted(points), float)
    slope, intercept = np.polyfit(k, np.array([points[int(x)] for x in k], float), 1)
    return {"measured": {str(x): points[x] for x in sorted(points)},
            "bytes_per_process": float(slope), "intercept_bytes": float(intercept),
            "processes": at, "extrapolated_bytes": float(intercept + slope * at)}


def memory(spec: Path, tmp: Path, procs: tuple[int, ...] = MEMORY_PROCS,
           peer: dict | None = None) -> dict:
    """Ours (plane + clients) against per-rank catalogs, and, given ``peer`` (the keyword
    arguments of ``plane_energon.energon_memory`` but ``procs``, ``fit`` and
    ``processes``), against Energon's loader workers over the same sources as tars."""
    processes = RANKS * WORKERS
    plane, url = serve(spec, tmp / "state-memory", RANKS, RANKS * 16)
    ours: dict[int, int] = {}
    try:
        from omniscale.dataplane.client import PlaneClient

        with PlaneClient(url) as client:  # every rank's plans served: the plane's tables exist
            for step in range(4):
                for rank in range(RANKS):
                    client.get_plan(step, rank)
        for k in procs:
            clients, _ = _held([self_command("--role", "client", url, str(r))
                                for r in range(k)])
            ours[k] = pss_bytes(plane.popen.pid) + sum(pss_bytes(c.popen.pid) for c in clients)
            for c in clients:
                c.stop()
        plane_bytes = pss_bytes(plane.popen.pid)
    finally:
        plane.stop()
    replicas: dict[int, int] = {}
    bare: dict[int, int] = {}
    for k in procs:
        for role, points in (("replica", replicas), ("bare", bare)):
            children, reports = _held([self_command("--role", role, str(spec))
                                       for _ in range(k)])
            points[k] = sum(pss_bytes(c.popen.pid) for c in children)
            if role == "replica":
                state_bytes = reports[0]["replica_bytes"]
            for c in children:
                c.stop()
    ours_fit, base_fit = _fit(ours, processes), _fit(replicas, processes)
    bare_fit = _fit(bare, processes)
    # State only: each side's extra over a bare process, per process, times the processes.
    per = bare_fit["bytes_per_process"]
    base_state = (base_fit["bytes_per_process"] - per) * processes
    ours_state = plane_bytes + max(ours_fit["bytes_per_process"] - per, 0.0) * processes
    out = {"method": f"PSS of real processes at {', '.join(map(str, procs))} per side, "
                     f"least-squares line, extrapolated to {processes} processes",
           "plane_bytes": plane_bytes,
           "ours": ours_fit, "baseline": base_fit, "bare": bare_fit,
           "replica_state_bytes": state_bytes,
           "ratio": base_fit["extrapolated_bytes"] / ours_fit["extrapolated_bytes"],
           "state_only": {"baseline_bytes": base_state, "ours_bytes": ours_state,
                          "ratio": base_state / ours_state}}
    if peer is not None:
        from omniscale.tools.bench.plane_energon import energon_memory

        energon = energon_memory(procs=procs, fit=_fit, processes=processes, **peer)
        state = energon["workers"]["bytes_per_process"] - energon["bare"]["bytes_per_process"]
        energon["ratio"] = energon["workers"]["workers_bytes"] / ours_fit["extrapolated_bytes"]
        energon["state_only"] = {"energon_bytes": state * processes, "ours_bytes": ours_state,
                                 "ratio": state * processes / ours_state}
        out["energon"] = energon
    return out


def serving(spec: Path, tmp: Path, clients: int, seconds: float, mode: str = "lane",
            rate: float = 0.0, warmup: float = 2.0, procs: int = 4) -> dict:
    """``clients`` clients in ``procs`` processes; closed loop (``rate`` 0) or paced at
    ``rate`` fetches/s in aggregate. ``mode``: the client's transport (see fetch_role)."""
    import numpy as np

    plane, url = serve(spec, tmp / f"state-serving-{mode}-{rate:g}", clients, clients * 8)
    per = clients // procs
    load_before = os.getloadavg()
    try:
        workers = [Child(self_command("--role", "fetch", url, str(p * per), str(per),
                                      str(seconds), mode, str(rate / clients), str(warmup)),
                         stdin=True)
                   for p in range(procs)]
        for worker in workers:
            assert worker.line().strip() == "ready"
        start = time.perf_counter()
        for worker in workers:
            worker.popen.stdin.write("go\n")
            worker.popen.stdin.flush()
        time.sleep(warmup)
        pids = [w.popen.pid for w in workers]
        cpu0 = cpu_seconds(plane.popen.pid), sum(map(cpu_seconds, pids))
        time.sleep(seconds)
        cpu1 = cpu_seconds(plane.popen.pid), sum(map(cpu_seconds, pids))
        results = [json.loads(worker.line()) for worker in workers]
        wall = time.perf_counter() - start
    finally:
        plane.stop()
    lat = np.concatenate([np.array(r["latencies_ms"]) for r in results])
    fetches = sum(r["fetches"] for r in results)
    pct = {f"p{q:g}_ms": float(np.percentile(lat, q)) for q in (50, 99, 99.9)} if fetches else {}
    return {"clients": clients, "processes": procs, "mode": mode, "rate": rate,
            "rate_per_client": rate / clients, "warmup_s": warmup, "seconds": seconds,
            "fetches": fetches, "fetches_per_s": fetches / seconds, "wall_s": wall, **pct,
            "max_ms": float(lat.max()) if fetches else None,
            "late_20ms": float((lat > 20).mean()) if fetches else None,
            "plane_cpu_us_per_fetch": (cpu1[0] - cpu0[0]) / max(fetches, 1) * 1e6,
            "clients_cpu_us_per_fetch": (cpu1[1] - cpu0[1]) / max(fetches, 1) * 1e6,
            "load_avg_before": load_before[0], "load_avg_after": os.getloadavg()[0]}


PLAN_RANKS = (1024, 4096)  # the planning runs' job sizes (--full adds 16,384)
JOB_STEPS_PER_S = 2.0  # a job's consumption the plane must stay ahead of (issue #44 item 5)


def planning(spec: Path, tmp: Path, windows: int, dp: int = 1024) -> dict:
    """The plane's own work for a ``dp``-rank job, 8 samples per rank per step, window 4,
    timed by phase per window: the draw (the mixer's global batches and the window's arrays),
    the plan (``plan_policy``), the best baseline's prediction beside each step
    (``best_baseline``), every rank's table (``window_rank_tables``) and every rank's
    fingerprint (what a whole-step commit checks). The first window (numba's compile or cache
    load, once per process) is timed apart. Memory: the process's RSS growth per window held
    with its tables, and the estimate for the windows a plane holds (``plan_ahead`` + 2)."""
    from omniscale.dataplane import plane_state
    from omniscale.dataplane.plane import DataPlane, PlaneConfig

    W = 4
    spent: dict[str, float] = {}
    wrapped = {}
    for name, phase in (("plan_policy", "plan"), ("best_baseline", "baselines"),
                        ("window_rank_tables", "tables")):
        fn = wrapped[name] = getattr(plane_state, name)

        def timed(*a, _fn=fn, _phase=phase, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_phase] = spent.get(_phase, 0.0) + time.perf_counter() - t0
        setattr(plane_state, name, timed)
    try:
        config = PlaneConfig(dp=dp, window=W, global_batch_samples=8 * dp,
                             micro_batch_tokens=16384, plan_ahead=0)
        rss0 = rss_bytes()
        start = time.perf_counter()
        # a state dir of its own: one holding another run's log would resume that run's spec
        plane = DataPlane(spec, tmp / f"state-planning-{dp}-{spec.stem}", config)  # window 0
        first_window = time.perf_counter() - start
        rss1 = rss_bytes()
        spent.clear()
        first = plane.next_window
        start = time.perf_counter()
        plane.state.plan_through((first + windows) * W - 1)  # windows first .. +windows-1
        drawn = time.perf_counter() - start
        for k in range(first, first + windows):
            for step in range(k * W, (k + 1) * W):
                plane.state.table(step, 0)  # builds every rank's table of the step
        start = time.perf_counter()
        for k in range(first, first + windows):
            for step in range(k * W, (k + 1) * W):
                plane.state.step_fingerprints(step)  # what a commit checks
        prints = time.perf_counter() - start
        rss2 = rss_bytes()
    finally:
        for name, fn in wrapped.items():
            setattr(plane_state, name, fn)
    per = {"draw": (drawn - spent.get("plan", 0.0)) / windows,
           **{phase: spent.get(phase, 0.0) / windows
              for phase in ("plan", "baselines", "tables")},
           "fingerprints": prints / windows}
    serve = sum(v for k, v in per.items() if k != "fingerprints")
    total = serve + per["fingerprints"]
    window_bytes = (rss2 - rss1) / windows
    held = PlaneConfig(dp=dp, global_batch_samples=8 * dp).plan_ahead + 2  # the default
    return {"dp": dp, "samples_per_step": 8 * dp, "window": W, "windows": windows,
            "first_window_s": first_window, "s_per_window": per,
            "plan_s_per_window": per["plan"], "serve_s_per_window": serve,
            "total_s_per_window": total, "windows_per_s": 1.0 / total,
            "steps_per_s": W / total, "steps_per_s_without_fingerprints": W / serve,
            "job_steps_per_s": JOB_STEPS_PER_S,
            "fetches_per_s_needed": JOB_STEPS_PER_S * dp,
            "memory": {"rss_before_bytes": rss0, "rss_first_window_bytes": rss1,
                       "rss_after_bytes": rss2, "bytes_per_window": window_bytes,
                       "windows_held": held,
                       "plane_bytes_estimate": rss1 + window_bytes * held,
                       "method": "RSS of this process (the plane in-process, no clients): "
                                 "growth per planned window with every rank's tables and "
                                 f"fingerprints, times the {held} windows a plane holds "
                                 "(plan_ahead 2 + the current + the previous) on top of the "
                                 "RSS with its first window planned: an upper estimate"}}


# -- report ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="100 sources, short runs")
    size.add_argument("--full", action="store_true", help="1,000 x 100 x 1,000 samples")
    parser.add_argument("--out", default="bench-plane.json", help="JSON output path")
    parser.add_argument("--data", help="keep the synthetic sources here (reused if present)")
    parser.add_argument("--serving-only", action="store_true",
                        help="only the serving runs (100 sources; no memory, no planning)")
    parser.add_argument("--planning-only", action="store_true",
                        help="only the planning runs (100 sources; no memory, no serving)")
    parser.add_argument("--plan-ranks", help="comma-separated job sizes of the planning runs "
                        "(default 1024,4096; with --full 1024,4096,16384)")
    parser.add_argument("--plan-schedule", default="const",
                        help="the planning runs' mixtures, comma-separated, each run at every "
                             "size in turn: const (equal weights, the default) and "
                             "tokens-ramp (a curriculum moving at every token drawn: a linear "
                             "ramp over tokens, the shape of configs/examples' long-context "
                             "phase)")
    parser.add_argument("--seconds", type=float, help="measured seconds per serving run "
                        "(default 10, --quick 3)")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each serving "
                        "run (default 2, --quick 1)")
    parser.add_argument("--rate", type=float, default=TARGETS["fetches_per_s"],
                        help="aggregate fetches/s of the paced runs (default 5000)")
    parser.add_argument("--clients", type=int, default=SERVE_RANKS)
    parser.add_argument("--procs", type=int, default=PROCS,
                        help="client processes (the clients are split among them)")
    parser.add_argument("--memory-procs", default=",".join(map(str, MEMORY_PROCS)),
                        help="processes per side the memory line is fitted to (at least 2 "
                             "counts)")
    parser.add_argument("--no-peer", action="store_true",
                        help="memory against our per-rank catalogs only, not Energon's "
                             "workers (tools/bench/plane_energon.py)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="transports to measure (action is the baseline; lane is ours)")
    parser.add_argument("--note", help="kept in the JSON as is: what code was measured, when "
                        "not this checkout's commit")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)  # child processes
    args = parser.parse_args(argv)
    if args.role:
        role, *rest = args.role
        {"replica": lambda: replica_role(*rest),
         "bare": lambda: bare_role(),
         "client": lambda: client_role(rest[0], int(rest[1])),
         "fetch": lambda: fetch_role(rest[0], int(rest[1]), int(rest[2]), float(rest[3]),
                                     rest[4], float(rest[5]), float(rest[6]))}[role]()
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not {"action", "lane"} <= set(modes) or not set(modes) <= set(MODES):
        parser.error(f"--modes: a subset of {','.join(MODES)} with action and lane")
    try:
        memory_procs = tuple(sorted({int(x) for x in args.memory_procs.split(",")}))
    except ValueError:
        memory_procs = ()
    if len(memory_procs) < 2 or memory_procs[0] < 1:
        parser.error(f"--memory-procs {args.memory_procs}: two or more positive counts, "
                     "comma-separated")
    if args.clients % args.procs:
        parser.error("--clients must be a multiple of --procs")
    if args.serving_only and args.planning_only:
        parser.error("--serving-only and --planning-only exclude each other")
    plan_schedules = [x.strip() for x in args.plan_schedule.split(",") if x.strip()]
    if not plan_schedules or not set(plan_schedules) <= {"const", "tokens-ramp"}:
        parser.error(f"--plan-schedule {args.plan_schedule}: const and/or tokens-ramp, "
                     "comma-separated")
    plan_ranks = [int(x) for x in args.plan_ranks.split(",")] if args.plan_ranks \
        else [*PLAN_RANKS, *((16384,) if args.full else ())]
    scale = "quick" if args.quick or args.serving_only or args.planning_only \
        else "full" if args.full else "default"
    sources, shards, per_shard = SCALES[scale]
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 2.0)
    with tempfile.TemporaryDirectory(prefix="bench-plane-") as tmp_name:
        tmp = Path(tmp_name)
        data = Path(args.data) if args.data else tmp / "sources"
        start = time.perf_counter()
        names = write_sources(data / f"{sources}x{shards}x{per_shard}", sources, shards,
                              per_shard)
        root = data / f"{sources}x{shards}x{per_shard}"
        spec = write_spec(root / "mix.yaml", names)
        small = write_spec(root / "mix-small.yaml", names[:100])
        plan_specs = {"const": small, "tokens-ramp": write_spec(
            root / "mix-small-ramp.yaml", names[:100], ramp=True)}
        print(f"sources: {sources} x {shards} shards x {per_shard} samples "
              f"({time.perf_counter() - start:.0f} s to write)", flush=True)
        out = {"scale": {"sources": sources, "shards": shards, "per_shard": per_shard},
               "command": " ".join(["tools/bench/plane.py"] + (argv or sys.argv[1:])),
               **provenance(), **({"note": args.note} if args.note else {}),
               "cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()[0]}
        if out["load_avg_at_start"] > 0.5 * (os.cpu_count() or 1):
            print(f"warning: load average {out['load_avg_at_start']:.1f} on "
                  f"{os.cpu_count()} CPUs: other work shares the cores, latencies are noisy",
                  flush=True)
        if not (args.serving_only or args.planning_only):
            peer = None if args.no_peer else {
                "data": data, "sources": sources, "shards": shards,
                "check_per_shard": None if args.quick else per_shard}
            out["memory"] = memory(spec, tmp, memory_procs, peer)
        srv = {"rate": args.rate, "closed": {}, "paced": {},
               "note": "closed loop: throughput target; its latency is information (Little's "
                       "law: N back-to-back clients at mean latency L fetch N/L per second). "
                       "paced: open loop at `rate` fetches/s in aggregate, latency from each "
                       "fetch's due time: the latency target"}
        for load, rate in () if args.planning_only else (("closed", 0.0), ("paced", args.rate)):
            for mode in modes:
                r = serving(small, tmp, args.clients, seconds, mode, rate, warmup, args.procs)
                srv[load][mode] = r
                print(f"serving {load} {mode}: {r['fetches_per_s']:,.0f}/s p50 "
                      f"{r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms (CPU/fetch plane "
                      f"{r['plane_cpu_us_per_fetch']:.0f} us, clients "
                      f"{r['clients_cpu_us_per_fetch']:.0f} us; load {r['load_avg_before']:.1f})",
                      flush=True)
        if not args.planning_only:
            out["serving"] = srv
        if not args.serving_only:
            out["planning"] = []
            for dp in plan_ranks:  # fewer windows for the big jobs: each is seconds
                windows = 1 if args.quick or dp > 4096 else 2 if dp > 1024 else 5
                for schedule in plan_schedules:
                    out["planning"].append({**planning(plan_specs[schedule], tmp, windows, dp),
                                            "schedule": schedule})
                    p = out["planning"][-1]
                    print(f"planning {dp} ranks ({schedule}): {p['steps_per_s']:.2f} steps/s "
                          f"({', '.join(f'{k} {v:.2f} s' for k, v in p['s_per_window'].items())}"
                          f" per window), plane "
                          f"~{p['memory']['plane_bytes_estimate'] / 2**20:,.0f} MiB", flush=True)
    out["load_avg_at_end"] = os.getloadavg()[0]
    out["rows"] = report(out)
    print_table(out["rows"])
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}", flush=True)
    return 0 if all(r["met"] for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
