"""``plane serve`` waits for SIGINT / SIGTERM with StopSignals: the kernel may hand the signal
to any of the process's threads, and a main thread blocked on a lock never saw one that a
gRPC or Arrow thread took (``bench plane`` hung for a minute on ``plane.stop()``)."""

import subprocess
import sys

import pytest

# A helper thread sends SIGTERM to itself (pthread_kill: this thread takes it, not the main
# one), after the main thread has begun to wait or before: either way the wait must return.
PROGRAM = """
import signal, threading
from omniscale.tools.plane_cli import StopSignals

signals = StopSignals()
threading.Thread(target=lambda: signal.pthread_kill(threading.get_ident(), signal.{sig})).start()
signals.wait()
print("stopped", flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_another_thread_takes_stops_the_wait(sig):
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(sig=sig)], capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr


def test_a_signal_to_the_main_thread_stops_the_wait():
    program = PROGRAM.replace("threading.get_ident()", "threading.main_thread().ident")
    done = subprocess.run([sys.executable, "-c", program.format(sig="SIGTERM")],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr
