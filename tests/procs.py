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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
