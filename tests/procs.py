"""Child processes for fault tests: output lines read by a thread into a queue, so a test
blocks on "the next line matching X" with a timeout -- synchronisation by what the process
says, never by sleeping. (On sys.path through pyproject's ``pythonpath = ["tests"]``.)"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class Proc:
    def __init__(self, args: list[str], timeout: float = 60.0):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.timeout = timeout
        self.popen = subprocess.Popen(args, cwd=ROOT, env=env, text=True, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str) -> re.Match:
        """Block until a line matches ``pattern``; fail if the process ends or stays silent."""
        while True:
            try:
                line = self.lines.get(timeout=self.timeout)
            except queue.Empty:
                pytest.fail(f"no {pattern!r} within {self.timeout} s:\n{''.join(self.output)}")
            if line is None:
                pytest.fail(f"exited before {pattern!r}:\n{''.join(self.output)}")
            if match := re.search(pattern, line):
                return match

    def resume(self) -> None:
        """A line on stdin (what a paused test trainer waits for)."""
        self.popen.stdin.write("\n")
        self.popen.stdin.flush()

    def finish(self, timeout: float | None = None) -> int:
        rc = self.popen.wait(timeout=timeout or self.timeout)
        assert rc == 0, "".join(self.output[-80:])
        return rc

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=self.timeout)


def free_port() -> int:
    """A port nothing listens on, for a server a test starts (and may restart on the same
    port), taken below Linux's ephemeral range (32768-60999): a port from that range can
    become some other connection's source port in the seconds before the server binds it
    (seen once in a full suite run, the plane guide's plane unreachable)."""
    import random

    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the low range all taken: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Spinners:
    """``count`` busy loops pinned to CPU ``core`` (noisy neighbours) for the ``with`` block;
    entered once every loop runs (each says so), killed on exit."""

    def __init__(self, core: int, count: int = 1):
        self.core, self.count, self.procs = core, count, []

    def __enter__(self) -> "Spinners":
        import sys

        code = ("import os; os.sched_setaffinity(0, {%d}); print('ready', flush=True)\n"
                "while True: pass" % self.core)
        self.procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                       text=True) for _ in range(self.count)]
        try:
            assert all(p.stdout.readline().strip() == "ready" for p in self.procs)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
