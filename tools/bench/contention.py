"""Whether a CPU bench run had the machine to itself: what other processes took of the CPUs
while it ran (:class:`Contention`), and a wait for a quiet machine before it (:func:`wait_quiet`).

On a shared machine another user's processes slow some runs and not others; a 2-process CPU
run is only a measurement while they take little. The e2e benches time each run with this
and wait for quiet before it.
"""

from __future__ import annotations

import os
import time

TICK = os.sysconf("SC_CLK_TCK")


def _busy_s() -> float:
    """CPU seconds the machine has spent busy since boot, all CPUs (``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / TICK  # less idle and iowait


def _tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user + system) of ``root`` and every live descendant, by pid."""
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            procs[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / TICK)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, stack = {}, [root]
    while stack:
        pid = stack.pop()
        if pid in procs:
            out[pid] = procs[pid][1]
            stack += children.get(pid, [])
    return out


class Contention:
    """What other processes took of the machine's CPUs while the block ran: the machine's
    busy CPU seconds (``/proc/stat``) less this process tree's (``/proc/PID/stat``, sampled
    every ``every`` s by a thread, so a process of ours that ends is counted to its last
    sample), as a share of all CPUs' time. A 2-process CPU run on a shared machine is only a
    measurement while that share is small."""

    def __init__(self, every: float = 0.5):
        self.every, self.share, self.wall_s = every, 0.0, 0.0

    def __enter__(self) -> "Contention":
        import threading

        self._stop = threading.Event()
        self._base = _tree_cpu(os.getpid())
        self._last = dict(self._base)
        self._t0, self._busy0 = time.perf_counter(), _busy_s()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self._last.update(_tree_cpu(os.getpid()))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._last.update(_tree_cpu(os.getpid()))
        self.wall_s = time.perf_counter() - self._t0
        ours = sum(v - self._base.get(pid, 0.0) for pid, v in self._last.items())
        foreign = max(_busy_s() - self._busy0 - ours, 0.0)
        self.share = foreign / max(self.wall_s * (os.cpu_count() or 1), 1e-9)


def wait_quiet(max_share: float, limit_s: float, probe_s: float = 3.0) -> dict:
    """Wait (up to ``limit_s``) until other processes take under ``max_share`` of the CPUs
    over a ``probe_s`` probe; how long it waited and the last probe's share (None: no
    wait asked for, no probe)."""
    if limit_s <= 0:
        return {"waited_s": 0.0, "share_before": None}
    t0 = time.perf_counter()
    while True:
        with Contention() as c:
            time.sleep(probe_s)
        waited = time.perf_counter() - t0
        if c.share < max_share or waited >= limit_s:
            return {"waited_s": round(waited, 1), "share_before": round(c.share, 3)}
