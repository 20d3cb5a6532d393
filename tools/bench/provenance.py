"""Where a benchmark's figures come from: the commit that produced them (and whether the tree
had uncommitted changes) and how busy the machine was when the run started. Every bench's
JSON carries it, so a figure in the README can be traced to the code and the conditions."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def provenance() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
        # the benches' own outputs (docs/bench/) are no change to the code that measures:
        # `omniscale bench all --write-docs` writes them one after another from one commit
        changed = subprocess.run(["git", "status", "--porcelain"], cwd=REPO,
                                 capture_output=True, text=True).stdout.splitlines()
        dirty = any(not line[3:].strip('"').startswith("docs/bench/") for line in changed)
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {"git_commit": commit, "git_dirty": dirty, "load_avg_at_start": os.getloadavg(),
            "cpus": os.cpu_count()}
