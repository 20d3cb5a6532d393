"""The launch scripts a user copies (tools/launch/): slurm_node.sh -- what slurm.sbatch runs on
each node -- on one simulated Slurm node with the data plane it starts, real processes
throughout; the scripts' one-line refusals. torchrun.sh trains two local ranks in
tests/tools/test_train_torchrun.py (against spawned ranks' batches)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omniscale.tools.train.metrics import read_metrics
from tests.dataplane.test_plane_tls import make_cert
from tests.procs import free_port
from tests.tools.train_runs import few_sources

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "tools" / "launch"


@pytest.fixture(scope="module")
def mix(demo, tmp_path_factory):
    """Three of the demo's sources (absolute paths, indexed with the demo)."""
    return few_sources(demo, tmp_path_factory.mktemp("spec") / "mix.yaml")


def _train_args(mix, out: Path) -> list[str]:
    sets = {"data.spec": mix, "data.workers": 0, "eval.enabled": False,
            "data.global_batch_tokens": 8192, "data.micro_batch_tokens": 4096,
            "optim.warmup_steps": 1, "steps": 2, "output_dir": out}
    return ["configs/demo_omni.yaml", "--no-progress",
            *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]


def _env(**extra) -> dict[str, str]:
    """This environment without Slurm's, CUDA's or a plane token, and with no `scontrol` on
    PATH (the scripts must do without it), plus ``extra``."""
    drop = ("SLURM_", "CUDA_VISIBLE_DEVICES", "OMNISCALE_PLANE_", "PLANE_", "NNODES",
            "NPROC_PER_NODE", "NODE_RANK", "MASTER_", "LAUNCH_DIR")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if not Path(d, "scontrol").exists())
    return {**env, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **extra}


def _processes_naming(path: Path) -> list[int]:
    """Live processes whose command line names ``path`` (each test's own tmp_path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            with contextlib.suppress(OSError):
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def _run(args: list[str], env: dict, tmp_path: Path, timeout: float = 240):
    """Run a script to its end: (rc, stdout, stderr). What it leaves behind is checked by
    the caller; whatever is left when this returns is killed (by process id)."""
    popen = subprocess.Popen(args, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        out, err = popen.communicate()
        pytest.fail(f"{args[0]} still running after {timeout} s:\n{out[-3000:]}{err[-3000:]}")
    return popen.returncode, out, err


@pytest.fixture
def no_strays(tmp_path):
    """After the test: no process of it still running (kill them if there are, then fail)."""
    yield
    left = _processes_naming(tmp_path)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running: {left}"


@pytest.mark.timeout(300)
def test_slurm_node_script_serves_the_plane_and_trains(mix, tmp_path, no_strays):
    """One node of a Slurm job, as srun starts it: the plane on this ("the first") node over
    TLS (a certificate for the node's name, which the ranks check), its URL and token in the
    job's directory, the ranks on it, the plane stopped after."""
    out, job = tmp_path / "run", "4242"
    cert, key = make_cert(tmp_path, "plane")
    env = _env(SLURM_JOB_ID=job, SLURM_NNODES="1", SLURM_NODEID="0", SLURM_PROCID="0",
               SLURM_NTASKS="1", SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=str(tmp_path),
               NPROC_PER_NODE="1", MASTER_PORT=str(free_port()), PLANE_TLS_CERT=cert,
               PLANE_TLS_KEY=key)
    t0 = time.monotonic()
    rc, stdout, stderr = _run([str(LAUNCH / "slurm_node.sh"), *_train_args(mix, out)], env,
                              tmp_path)
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    print(f"slurm_node.sh, 1 rank x 2 steps: {time.monotonic() - t0:.1f} s")
    launch_dir = tmp_path / f"omniscale-slurm-{job}"
    plane_file = launch_dir / "plane-0.url"
    url, token = plane_file.read_text().splitlines()
    assert re.fullmatch(r"grpc\+tls://localhost:\d+", url) and len(token) >= 32
    assert plane_file.stat().st_mode & 0o077 == 0  # the token is for this user only
    assert token not in stdout + stderr
    assert not list(launch_dir.glob(".plane.*"))  # the temporary file was renamed
    log = (launch_dir / "plane.log").read_text()
    assert f"serving grpc+tls://0.0.0.0:{url.rsplit(':', 1)[1]} " in log
    assert "omniscale plane: stopped at step 2" in log  # stopped after the ranks, cleanly
    assert (out / "plane.url").read_text().strip() == url  # the ranks used this plane
    assert len(read_metrics(out / "metrics.jsonl")) == 2
    from omniscale.dataplane.audit import audit_state_dir

    audit = audit_state_dir(out / "plane")  # the plane's state: in the run directory
    assert audit["next_step"] == 2 and audit["duplicated"] == 0
    assert not audit["fingerprint_mismatches"]


def _one_line_refusal(script: str, env: dict, match: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    rc, stdout, stderr = _run([str(LAUNCH / script), "configs/demo_omni.yaml"], env, tmp_path,
                              timeout=30)
    assert rc == 2 and stdout == ""
    assert len(stderr.splitlines()) == 1 and re.search(match, stderr), stderr
    assert time.monotonic() - t0 < 10  # before any Python starts


def test_torchrun_script_refuses_several_nodes_without_a_plane(tmp_path):
    _one_line_refusal("torchrun.sh", _env(NNODES="2", NODE_RANK="1"),
                      r"^torchrun\.sh: NNODES=2 needs an external data plane: set PLANE_URL",
                      tmp_path)


def test_slurm_node_script_refuses_a_plane_without_tls_or_consent(tmp_path):
    _one_line_refusal("slurm_node.sh", _env(SLURM_JOB_ID="7", SLURM_NNODES="2",
                                            SLURM_NODEID="1", SLURM_JOB_NODELIST="n[1-2]"),
                      r"set PLANE_TLS_CERT and PLANE_TLS_KEY \(a certificate for n1\), or "
                      r"PLANE_INSECURE=1", tmp_path)


def test_slurm_node_script_waits_for_the_plane_file_a_bounded_time(tmp_path):
    """A node other than the first whose plane URL file never comes: one line, not a hang."""
    _one_line_refusal("slurm_node.sh", _env(SLURM_JOB_ID="8", SLURM_NNODES="2",
                                            SLURM_NODEID="1", SLURM_JOB_NODELIST="localhost",
                                            SLURM_SUBMIT_DIR=str(tmp_path), PLANE_INSECURE="1",
                                            PLANE_WAIT="1"),
                      r"^slurm_node\.sh: no .*omniscale-slurm-8/plane-0\.url \(the first node "
                      r"starts the data plane\) after 1s$", tmp_path)


@pytest.mark.parametrize("nodelist, first", [("node[03-04,07],gpu1", "node03"),
                                             ("gpu5,node[1-2]", "gpu5"),
                                             ("localhost", "localhost")])
def test_first_host_of_a_nodelist_without_scontrol(nodelist, first):
    done = subprocess.run(["bash", "-c", f'source "{LAUNCH}/slurm_node.sh"; first_host "$1"',
                           "_", nodelist], env=_env(), capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0 and done.stdout == f"{first}\n", done.stderr


def test_plane_args_plan_for_the_data_ranks(mix, tmp_path):
    """The plane's --dp is the data ranks: 4 processes at tp=2 are 2 of them; its cost model
    is the model's own, as the embedded plane's: `plane serve` with these flags plans with
    the embedded plane's very settings."""
    from omniscale.tools.cli import build_parser
    from omniscale.tools.launch.plane_args import serve_flags
    from omniscale.tools.plane_cli import serve_config
    from omniscale.tools.train.config import load_config
    from omniscale.tools.train.loop import layout, plane_config

    sets = [f"data.spec={mix}", "parallel.tp=2", "checkpoint_every=7", "data.window=2"]
    cfg, _ = load_config(ROOT / "configs" / "demo_omni.yaml", sets)
    flags = serve_flags(cfg, tmp_path / "run", world=4)
    got = dict(zip(flags[::2], flags[1::2], strict=True))
    _, mcfg, dims, groups = layout(cfg, 4)
    embedded = plane_config(cfg, dims.dp_sp, mcfg.cost_coefficients(), groups.frozen_kinds)
    assert embedded.cost_linear != 24576.0  # not the plane's default: the model's α/β
    assert got == {"--spec": str(mix), "--state-dir": str(tmp_path / "run" / "plane"),
                   "--dp": "2", "--sp-max": "1", "--balance": "omniscale", "--window": "2",
                   "--global-batch-tokens": "8192", "--micro-batch-tokens": "4096",
                   "--snapshot-every": "7", "--cost-linear": repr(embedded.cost_linear),
                   "--cost-quadratic": repr(embedded.cost_quadratic)}
    assert serve_config(build_parser().parse_args(["plane", "serve", *flags])) == embedded


@pytest.mark.parametrize("flags, message", [
    (["--cost-linear", "nan"], "--cost-linear nan: must be finite, in [0, 1e+12]"),
    (["--cost-quadratic", "-1"], "--cost-quadratic -1: must be finite"),
    (["--cost-linear", "0", "--cost-quadratic", "0"], "not both 0"),
    (["--costs", "costs.json", "--cost-linear", "1"], "--costs and --cost-linear"),
])
def test_plane_serve_refuses_a_bad_cost_model_in_one_line(flags, message, tmp_path, capsys):
    from omniscale.tools.cli import main

    base = ["plane", "serve", "--state-dir", str(tmp_path / "state"), "--dp", "2",
            "--global-batch-tokens", "4096"]
    assert main(base + flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "state").exists()  # refused before anything started


@pytest.mark.parametrize("given,passed", [
    (["cfg.yaml", "--set", "steps=2"], ["cfg.yaml", "--set", "steps=2", "--resume", "auto"]),
    (["cfg.yaml", "--resume", "runs/x"], ["cfg.yaml", "--resume", "runs/x"]),
    (["cfg.yaml", "--resume=runs/x", "--set", "a=b c"], ["cfg.yaml", "--resume=runs/x",
                                                         "--set", "a=b c"]),
])
def test_a_requeued_slurm_node_resumes_unless_told_otherwise(given, passed):
    """A requeued job reruns slurm_node.sh with the same arguments: `--resume auto` is added
    (the run continues from its newest checkpoint, or starts) unless the user named one."""
    script = f'source "{LAUNCH}/slurm_node.sh"; with_auto_resume "$@" | xargs -0 printf "%s\\n"'
    done = subprocess.run(["bash", "-c", script, "-", *given], capture_output=True, text=True,
                          check=True)
    assert done.stdout.splitlines() == passed
