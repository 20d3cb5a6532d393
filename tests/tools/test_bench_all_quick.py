"""`omniscale bench all --quick` end to end on CPU, as a user runs it on a fresh clone: every
bench as its own process, its data generated from nothing, its JSON collected and mapped to
headline rows. A bench that fails (an import shadowed, a data writer behind the index format)
fails its test here with the bench's own last lines.

One test per bench (``--only NAME``), so the suite's two workers share them; the benches on one
worker share one scratch directory (``TMPDIR``), so the demo data they read is generated once
per worker, from nothing."""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from omniscale.tools.bench.all import BENCHES
from tests.tools.test_balance_sim import assert_fair_comparison

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # the slowest quick bench takes about a minute on 2 shared cores: a hang


def docs_bench_digest() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((REPO / "docs" / "bench").glob("*"))}


@pytest.fixture(scope="session")
def scratch(tmp_path_factory):
    """The benches' TMPDIR on this worker (their `--data` default is $TMPDIR/omniscale-bench):
    empty at first, as on a fresh clone. Short, for Ray's socket paths under it."""
    path = Path(tempfile.mkdtemp(prefix="bench-all-"))
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _marks(name: str) -> list:
    # ray_loader starts a Ray cluster: with the other Ray tests, never two at once on two cores
    return [pytest.mark.xdist_group("ray")] if name == "ray_loader" else []


def run_or_show_where_it_hung(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run ``bench all``; past TIMEOUT_S, kill it and its bench's whole process tree and fail
    with the last lines it printed (the runner echoes its script's lines as they come, so
    they name the section it hung in)."""
    with subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"still running after {TIMEOUT_S} s; its last lines:\n"
                        + "\n".join((stdout + stderr).splitlines()[-40:]))
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n, b in BENCHES.items()
                                  if not b.variant_of])  # a variant's script runs as its bench
def test_the_bench_runs_in_quick_mode_on_cpu(name, scratch, tmp_path):
    env = dict(os.environ, TMPDIR=str(scratch))
    # ... but torch.compile's cache where it always is ($TMPDIR/torchinductor_USER, before
    # the change): compiling the kernels' C++ again is no part of what this checks
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir())
                                                  / f"torchinductor_{getpass.getuser()}"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = tmp_path / "bench-results.json"
    committed = docs_bench_digest()
    proc = run_or_show_where_it_hung([sys.executable, "-m", "omniscale", "bench", "all",
                                      "--quick", "--only", name, "--out", str(out)], env)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    record = results["benches"][name]
    assert record["status"] != "failed", json.dumps(
        [record.get("error"), *record.get("output_tail", [])], indent=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert results["quick"] is True and list(results["benches"]) == [name]
    if BENCHES[name].needs_cuda and record["status"] == "skipped":
        return  # gpu_check, without CUDA: said so, not run
    assert record["status"] in ("ok", "targets missed"), record["status"]
    assert record["headlines"], f"{name}: its JSON gave no headline row"
    assert "$SCRATCH" in record["command"] or BENCHES[name].json_in_out_dir
    if name == "balance":  # its own JSON, whole: every baseline given our split, same comm
        assert record["result"]["quick"] is True
        assert_fair_comparison(record["result"])
        assert any(r["metric"].startswith("planner ms/step") for r in record["headlines"])
    # the committed figures are not what quick runs write
    assert docs_bench_digest() == committed
    table = out.with_suffix(".md").read_text()
    assert table.startswith("# OmniScale benchmarks (--quick)")
    assert f"| {name} | {record['status']} |" in table
