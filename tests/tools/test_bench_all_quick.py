"""`omniscale bench all --quick` end to end on CPU, as a user runs it on a fresh clone: every
bench as its own process, its data generated from nothing, its JSON collected and mapped to
headline rows. A bench that fails (an import shadowed, a data writer behind the index format)
fails this test with the bench's own last lines."""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from omniscale.tools.bench.all import BENCHES
from tests.tools.test_balance_sim import assert_fair_comparison

REPO = Path(__file__).resolve().parents[2]
# The whole quick run takes a few minutes on 2 cores; the limit only catches a hang.
TIMEOUT_S = 540


def docs_bench_digest() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((REPO / "docs" / "bench").glob("*"))}


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
# ray_loader starts a Ray cluster: with the other Ray tests, never two at once on two cores
@pytest.mark.xdist_group("ray")
def test_every_bench_runs_in_quick_mode_on_cpu(tmp_path):
    # A fresh temporary directory: the benches' data (`--data`, default $TMPDIR/omniscale-bench)
    # is generated from nothing, as on a fresh clone. Short, for Ray's socket paths under it.
    scratch = Path(tempfile.mkdtemp(prefix="bench-all-"))
    env = dict(os.environ, TMPDIR=str(scratch))
    # ... but torch.compile's cache where it always is ($TMPDIR/torchinductor_USER, before
    # the change): compiling the kernels' C++ again is no part of what this checks
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir())
                                                  / f"torchinductor_{getpass.getuser()}"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = tmp_path / "bench-results.json"
    committed = docs_bench_digest()
    try:
        proc = subprocess.run([sys.executable, "-m", "omniscale", "bench", "all", "--quick",
                               "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    benches = results["benches"]
    failed = {name: [r.get("error"), *r.get("output_tail", [])]
              for name, r in benches.items() if r["status"] == "failed"}
    assert not failed, json.dumps(failed, indent=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert results["quick"] is True and list(benches) == list(BENCHES)
    for name, record in benches.items():
        if BENCHES[name].needs_cuda and record["status"] == "skipped":
            continue
        assert record["status"] in ("ok", "targets missed"), (name, record["status"])
        assert record["headlines"], f"{name}: its JSON gave no headline row"
        assert "$SCRATCH" in record["command"] or BENCHES[name].json_in_out_dir
    # the balance bench's own JSON, whole: every baseline given our split, same communication
    assert benches["balance"]["result"]["quick"] is True
    assert_fair_comparison(benches["balance"]["result"])
    assert any(r["metric"].startswith("planner ms/step") for r in benches["balance"]["headlines"])
    # the committed figures are not what quick runs write
    assert docs_bench_digest() == committed
    table = out.with_suffix(".md").read_text()
    assert table.startswith("# OmniScale benchmarks (--quick)")
    assert all(f"| {name} | ok |" in table or f"| {name} | targets missed |" in table
               or f"| {name} | skipped |" in table for name in BENCHES)
