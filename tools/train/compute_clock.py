"""How long a rank computed during a step, without the time it waited for the other ranks.

Under FSDP every rank waits in the step's collectives for the slowest, so a step's wall time
is about the same on every rank and says nothing about balance. On CPU the clock reads CPU
time instead: a rank blocked in a gloo collective sleeps on a condition variable and uses
none. It counts the whole process (the step's own thread and the native threads it drives:
intra-op OpenMP workers, gloo's transport) minus every *other Python thread* of the process
(the loader's assembly and plan threads, an embedded plane, the metrics writer, an async
checkpoint writer), each read from the kernel's per-thread accounting: none of them computes
the model, and with ``data.workers: 0`` the assembly thread decodes beside the step.

On CUDA the wall time is all it has today (``kind = "wall"``): kernels run asynchronously
and NCCL waits sit in the compute stream's timeline, so an honest figure needs per-kernel
times (the profiler), which is not built yet.
"""

from __future__ import annotations

import threading
import time


def _other_threads_cpu() -> dict[int, float]:
    """CPU seconds of every live Python thread but the calling one, by native thread id, from
    ``/proc/self/task/TID/schedstat`` (nanoseconds on the CPU). Not ``pthread_getcpuclockid``:
    a thread that ends between ``enumerate()`` and the call leaves a dangling handle, and
    reading it crashed the process; a vanished ``/proc`` entry is just skipped."""
    me = threading.get_native_id()
    seconds = {}
    for thread in threading.enumerate():
        tid = thread.native_id
        if tid is None or tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                seconds[tid] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # it ended, or no schedstat here
            continue
    return seconds


class ComputeClock:
    """``start()`` before a step's work, ``stop()`` after: ``(wall_s, compute_s)``."""

    def __init__(self, device_type: str = "cpu") -> None:
        self.kind = "wall" if device_type == "cuda" else "cpu"
        self._wall = self._process = 0.0
        self._others: dict[int, float] = {}

    def start(self) -> None:
        self._wall = time.perf_counter()
        if self.kind == "cpu":
            self._process = time.process_time()
            self._others = _other_threads_cpu()

    def stop(self) -> tuple[float, float]:
        wall = time.perf_counter() - self._wall
        if self.kind == "wall":
            return wall, wall
        process = time.process_time() - self._process
        # a thread that started during the step counts from 0; an ident reused by a new
        # thread never subtracts less than nothing
        others = sum(max(now - self._others.get(ident, 0.0), 0.0)
                     for ident, now in _other_threads_cpu().items())
        return wall, max(process - others, 0.0)
