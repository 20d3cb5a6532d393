"""How long a rank computed during a step, without the time it waited for the other ranks.

Under FSDP every rank waits in the step's collectives for the slowest, so a step's wall time
is about the same on every rank and says nothing about balance. On CPU the clock reads the
time the rank's threads were *runnable* instead: on a CPU plus waiting in the run queue for
one (the kernel's per-thread ``schedstat``). A rank blocked in a gloo collective sleeps on a
condition variable and is neither, so waiting for the other ranks is left out; a rank that
shares its core with a noisy neighbour is runnable while the neighbour runs, so contention
counts, as it does for the step (CPU time alone would call that rank as fast as ever, and a
planner fed by it would never give it less work). It counts the whole process (the step's own
thread and the native threads it drives: intra-op OpenMP workers, gloo's transport) minus
every *other Python thread* of the process (the loader's assembly and plan threads, an
embedded plane, the metrics writer, an async checkpoint writer): none of them computes the
model, and with ``data.workers: 0`` the assembly thread decodes beside the step. Where the
kernel keeps no ``schedstat`` the clock falls back to CPU time (``kind = "cpu"``).

On CUDA the wall time is all it has today (``kind = "wall"``): kernels run asynchronously
and NCCL waits sit in the compute stream's timeline, so an honest figure needs per-kernel
times (the profiler), which is not built yet.
"""

from __future__ import annotations

import os
import threading
import time


def _schedstat(tid: int | str, fields: int) -> float | None:
    """Seconds of ``/proc/self/task/TID/schedstat``'s first ``fields`` fields (on a CPU, then
    waiting for one; nanoseconds), None when the thread is gone or the file is absent."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            return sum(int(v) for v in f.read().split()[:fields]) / 1e9
    except (OSError, ValueError):  # it ended, or no schedstat here
        return None


def _other_threads(fields: int) -> dict[int, float]:
    """Seconds (``_schedstat``) of every live Python thread but the calling one, by native
    thread id. Not ``pthread_getcpuclockid``: a thread that ends between ``enumerate()`` and
    the call leaves a dangling handle, and reading it crashed the process; a vanished
    ``/proc`` entry is just skipped."""
    me = threading.get_native_id()
    seconds = {}
    for thread in threading.enumerate():
        tid = thread.native_id
        if tid is None or tid == me:
            continue
        value = _schedstat(tid, fields)
        if value is not None:
            seconds[tid] = value
    return seconds


def _all_threads(fields: int) -> dict[str, float]:
    """Seconds (``_schedstat``) of every live thread of the process, Python's or native."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    seconds = {}
    for tid in tids:
        value = _schedstat(tid, fields)
        if value is not None:
            seconds[tid] = value
    return seconds


def _has_schedstat() -> bool:
    return _schedstat(threading.get_native_id(), 2) is not None


class ComputeClock:
    """``start()`` before a step's work, ``stop()`` after: ``(wall_s, compute_s)``.

    ``kind``: ``runnable`` (CPU default where the kernel keeps schedstat), ``cpu`` (CPU time
    only: blind to contention), ``wall`` (CUDA, waits included)."""

    def __init__(self, device_type: str = "cpu", kind: str | None = None) -> None:
        if kind is None:
            kind = "wall" if device_type == "cuda" else \
                "runnable" if _has_schedstat() else "cpu"
        if kind not in ("runnable", "cpu", "wall"):
            raise ValueError(f"kind: runnable, cpu or wall, got {kind!r}")
        self.kind = kind
        self._wall = self._process = 0.0
        self._others: dict[int, float] = {}
        self._threads: dict[str, float] = {}

    def start(self) -> None:
        self._wall = time.perf_counter()
        if self.kind == "runnable":
            self._threads = _all_threads(2)
        elif self.kind == "cpu":
            self._process = time.process_time()
            self._others = _other_threads(1)

    def lap(self) -> tuple[float, float]:
        """``stop()`` and ``start()`` again: the (wall, compute) seconds of one phase of a
        step, the next phase counted from now."""
        got = self.stop()
        self.start()
        return got

    def stop(self) -> tuple[float, float]:
        wall = time.perf_counter() - self._wall
        if self.kind == "wall":
            return wall, wall
        if self.kind == "runnable":
            # per thread since start (a thread started during the step counts from 0; one
            # that ended is lost, its time with it), the other Python threads left out
            others = {str(t.native_id) for t in threading.enumerate()
                      if t.native_id is not None and t.native_id != threading.get_native_id()}
            return wall, sum(max(now - self._threads.get(tid, 0.0), 0.0)
                             for tid, now in _all_threads(2).items() if tid not in others)
        process = time.process_time() - self._process
        # a thread that started during the step counts from 0; an ident reused by a new
        # thread never subtracts less than nothing
        others = sum(max(now - self._others.get(ident, 0.0), 0.0)
                     for ident, now in _other_threads(1).items())
        return wall, max(process - others, 0.0)
