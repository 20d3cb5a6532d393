"""How the launcher starts ranks: forked from a server process that imported the trainer once.

A spawned rank imports torch, the trainer, the loaders and the balancer itself: about 3 s of
CPU per rank on this project's CPU machines, N times per launch. Python's ``forkserver`` start
method imports them once, in a fresh server process, and forks every rank from it (the server
lives as long as the launching process, so later launches from the same process skip the
imports altogether). It is as safe as spawn with CUDA: the server never initialises a device
or runs a parallel region, it only imports.

A forked rank inherits the server's environment, not the launcher's: the launcher's
environment at launch time travels with the rank's arguments and replaces it
(:func:`adopt_environment`), so a variable set just before the launch (``--tls-root`` sets
one) reaches every rank as it would under spawn.
"""

from __future__ import annotations

import multiprocessing
import os

# What every rank imports, heaviest first; an import error here only means the rank imports it.
PRELOAD = ("torch", "omniscale.tools.train.loop", "omniscale.parallel.parallelize",
           "omniscale.loaders.index", "omniscale.balancer.planner", "pyarrow")


# Set: ranks are spawned instead (tools/bench/mutation_plugin.py sets it in the run coverage
# measures: a spawned rank is a new Python, measured from its start under the test that
# launched it; a rank forked from the server would carry the server's measurement, and its
# os._exit saves none)
SPAWN_ENV = "OMNISCALE_SPAWN_RANKS"


def start_method() -> str:
    """``"forkserver"``, with the preload set (it applies when the server first starts), or
    ``"spawn"`` when :data:`SPAWN_ENV` is set."""
    if os.environ.get(SPAWN_ENV):
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def start_early() -> None:
    """Start the server now, when ranks will be forked from it: it imports :data:`PRELOAD`
    (about 5 s of CPU) on another core while the launcher imports and checks the run (about
    3 s), instead of after. Nothing when ranks are spawned. The server it starts is the one
    the launch uses (one per process); it ends with this process, so a launch that stops on a
    bad config first loses nothing but the server's start."""
    if start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    forkserver.ensure_running()


def launch_environment() -> dict[str, str]:
    """The launcher's environment now, for :func:`adopt_environment` in each rank."""
    return dict(os.environ)


def adopt_environment(env: dict[str, str] | None) -> None:
    """Make this rank's environment the launcher's (``None``: keep what the process has)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
