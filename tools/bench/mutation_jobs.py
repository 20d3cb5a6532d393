"""``tools/bench/mutation.py --jobs N``: the modules shared among N drivers run side by side,
each in its own copy of the repository (a mutant is a file changed in place, so two at once
need two copies), their reports merged into one. Each job is the same script with the same
settings and its share of ``--module``; one torch thread each, so that N jobs on N cores do
not fight over them.

The share is the longest-first greedy one: modules by their time in the previous report
(``--out``, when it has them) or else their sampled mutant count, each to the job with the
least so far."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().with_name("mutation.py")


def share(weights: dict[str, float], jobs: int) -> list[list[str]]:
    """The modules (``weights``: module -> expected seconds) split among at most ``jobs``
    groups, longest first to the group with the least; empty groups dropped."""
    groups: list[list[str]] = [[] for _ in range(jobs)]
    loads = [0.0] * jobs
    for module in sorted(weights, key=lambda m: (-weights[m], m)):
        least = loads.index(min(loads))
        groups[least].append(module)
        loads[least] += weights[module]
    return [g for g in groups if g]


def run_jobs(groups: list[list[str]], settings: list[str], work: Path,
             reasons_from: Path) -> tuple[dict[str, dict], bool]:
    """Runs one driver per group (``settings``: the command-line options they share) and
    returns the modules' results merged, and whether every job finished. Ctrl-C or SIGTERM
    here stops the jobs (each restores its files as a single driver does) and merges what
    they wrote."""
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    jobs = []
    for i, group in enumerate(groups):
        out = work / f"job-{i}.json"
        out.unlink(missing_ok=True)
        command = [sys.executable, str(SCRIPT), *settings, "--jobs=1",
                   *(f"--module={m}" for m in group), f"--work={work / f'job-{i}'}",
                   f"--out={out}", f"--reasons-from={reasons_from}"]
        jobs.append((out, subprocess.Popen(command, env=env)))
    finished = True
    try:
        for _, job in jobs:
            finished &= job.wait() == 0
    except KeyboardInterrupt:
        finished = False
        for _, job in jobs:
            with contextlib.suppress(ProcessLookupError):
                job.send_signal(signal.SIGTERM)
        for _, job in jobs:
            job.wait()
    merged: dict[str, dict] = {}
    for out, _ in jobs:
        if out.is_file():
            merged.update(json.loads(out.read_text()).get("modules", {}))
    return merged, finished
