"""The launcher's fork server: started early when ranks will be forked from it, never when
they are spawned (each case in a fresh interpreter: a process has one server for life; the
preload is a light module there, so the probe's server does not import the trainer)."""

from __future__ import annotations

import os
import subprocess
import sys

from omniscale.tools.train.fork_server import SPAWN_ENV

PROBE = """
import os
from multiprocessing import forkserver
from omniscale.tools.train import fork_server

fork_server.PRELOAD = ("json",)
fork_server.start_early()
server = forkserver._forkserver
pid = server._forkserver_pid
print(pid is not None and os.path.exists(f"/proc/{pid}"), server._preload_modules == ["json"])
"""


def _probe(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_server_starts_early_with_the_preload_the_launch_sets():
    env = {k: v for k, v in os.environ.items() if k != SPAWN_ENV}
    assert _probe(env) == "True True"


def test_no_server_when_ranks_are_spawned():
    assert _probe({**os.environ, SPAWN_ENV: "1"}) == "False False"


CLI_PROBE = """
import sys
import types
from multiprocessing import forkserver
from omniscale.tools import cli
from omniscale.tools.train import fork_server

def train(*args, **kwargs):  # what the launch would find: the server already up, or not
    print(forkserver._forkserver._forkserver_pid is not None)

fork_server.PRELOAD = ("json",)
sys.modules["omniscale.tools.train.launch"] = types.SimpleNamespace(train=train)
cli.main(["train", "run.yaml", "--nproc", sys.argv[1]])
"""


def test_omniscale_train_starts_the_server_only_for_forked_ranks():
    env = {k: v for k, v in os.environ.items() if k != SPAWN_ENV}
    for nproc, started in (("2", "True"), ("1", "False")):
        done = subprocess.run([sys.executable, "-c", CLI_PROBE, nproc], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == started, (nproc, done.stdout)
