"""A plan lane in a process short of file descriptors (tests/dataplane/test_hostile_clients.py).

Prints ``port N`` once serving with RLIMIT_NOFILE lowered to a few descriptors above what is
open; then, per line on stdin: ``measure S`` waits (up to 30 s) until accept has failed for want
of descriptors, then prints the lane thread's CPU seconds over the next S seconds (``cpu X``);
``warnings`` prints how many out-of-descriptor warnings the lane logged (``warnings N``);
``quit`` stops."""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading
import time

import pyarrow as pa

from omniscale.dataplane.lane import PlanLane

SPARE_FDS = 8  # descriptors left for connections once the lane is up


class Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.descriptors = 0
        self.failed = threading.Event()

    def emit(self, record):
        if "accept failed" in record.getMessage():
            self.descriptors += 1
            self.failed.set()


def main() -> None:
    counter = Count()
    logging.getLogger("omniscale.dataplane.lane").addHandler(counter)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    lane = PlanLane(lambda body: pa.py_buffer(b"plan"), "127.0.0.1", None)
    lane.start()
    used = len(os.listdir("/proc/self/fd"))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + SPARE_FDS, hard))
    clock = time.pthread_getcpuclockid(lane._thread.ident)
    print(f"port {lane.port}", flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "measure":
            if not counter.failed.wait(30):
                print("cpu never-failed", flush=True)
                continue
            window = float(command[1])
            before = time.clock_gettime(clock)
            time.sleep(window)  # the measured window itself, not a synchronisation
            print(f"cpu {time.clock_gettime(clock) - before:.4f}", flush=True)
        elif command[0] == "warnings":
            print(f"warnings {counter.descriptors}", flush=True)
        elif command[0] == "quit":
            break
    lane.stop()


if __name__ == "__main__":
    main()
