"""Hangs: a watchdog per rank. No step finished for ``watchdog.step_timeout_s`` seconds (the
first step: twice that, for compilation and warm-up) and the rank writes every thread's stack
to ``RUN_DIR/hang-rankR.txt``, its one line to ``RUN_DIR/error-rankR.txt`` (the launcher raises
it) and stderr, and exits: a rank that waits forever in a collective, a loader or a
deadlock ends the run with a name and a place instead of holding the job until the scheduler
kills it.

The watchdog is a Python thread, so it needs the interpreter: a rank stuck in C code that holds
the GIL cannot run it. For that case ``faulthandler.dump_traceback_later`` -- a C thread that
needs no GIL -- is armed a minute later as a backstop: it dumps the stacks into the same file
and exits the process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import sys
import threading
import time
import traceback
from pathlib import Path

EXIT_HANG = 3  # the process's exit status when the watchdog fires
BACKSTOP_S = 60.0  # after the watchdog's own bound: faulthandler's
VICTIM_GRACE = 1.5  # the bound's factor for a rank waiting in a collective


class StepWatchdog:
    """Call :meth:`beat` after every step; :meth:`close` at the end (also on errors)."""

    def __init__(self, timeout_s: float, run_dir: Path, rank: int, first_step: int) -> None:
        self.timeout_s, self.run_dir, self.rank = timeout_s, Path(run_dir), rank
        self.step, self.since = first_step, time.monotonic()
        self.first = True
        self.main = threading.main_thread().ident
        self.stop = threading.Event()
        self.dump = open(self.run_dir / f"hang-rank{rank}.txt", "w")  # noqa: SIM115 -- C writes
        self._arm_backstop()
        self.thread = threading.Thread(target=self._watch, name=f"watchdog-rank{rank}",
                                       daemon=True)
        self.thread.start()

    def _bound(self) -> float:
        return self.timeout_s * (2 if self.first else 1)

    def _arm_backstop(self) -> None:
        faulthandler.dump_traceback_later(self._bound() + BACKSTOP_S, exit=True, file=self.dump)

    def beat(self, step: int) -> None:
        """Step ``step`` finished: the next one has a full bound again."""
        self.step, self.since, self.first = step + 1, time.monotonic(), False
        self._arm_backstop()

    @contextlib.contextmanager
    def paused(self, step: int):
        """No verdict while the block runs (a held-out evaluation: its length is the eval set's,
        not a step's; a rank stuck in it still ends at the collective time-out); a full bound
        after it."""
        self.since = math.inf
        faulthandler.cancel_dump_traceback_later()
        try:
            yield
        finally:
            self.beat(step)

    def close(self) -> None:
        self.stop.set()
        faulthandler.cancel_dump_traceback_later()
        self.thread.join()
        empty = self.dump.tell() == 0
        self.dump.close()
        if empty:  # no hang: no file
            Path(self.dump.name).unlink(missing_ok=True)

    def _watch(self) -> None:
        while not self.stop.wait(min(1.0, self.timeout_s / 4)):
            waited = self.overdue(time.monotonic())
            if waited is not None:
                self._fire(waited)

    def overdue(self, now: float) -> float | None:
        """Seconds without a finished step at ``now`` when that is past the bound, else None.
        A rank waiting in a collective waits for another: the one holding the job up fires
        first (its exit breaks the others' collectives, or they fire after it)."""
        waited = now - self.since
        grace = VICTIM_GRACE if self._in_collective() else 1.0
        return waited if waited > self._bound() * grace else None

    def _in_collective(self) -> bool:
        frame = sys._current_frames().get(self.main)
        while frame is not None:
            if f"torch{os.sep}distributed" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    def where(self) -> str:
        """The main thread's innermost frame: file:line function."""
        frame = sys._current_frames().get(self.main)
        if frame is None:
            return "unknown"
        last = traceback.extract_stack(frame)[-1]
        return f"{last.filename}:{last.lineno} {last.name}"

    def _fire(self, waited: float) -> None:
        line = (f"watchdog: rank {self.rank} finished no step for {waited:.0f} s (step "
                f"{self.step}; bound watchdog.step_timeout_s={self.timeout_s:g}), waiting in "
                f"{self.where()}; every thread's stack in {self.dump.name}")
        faulthandler.dump_traceback(file=self.dump, all_threads=True)
        self.dump.flush()
        (self.run_dir / f"error-rank{self.rank}.txt").write_text(line + "\n")
        print(line, file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)

