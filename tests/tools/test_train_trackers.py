"""``profile.steps`` (torch.profiler traces in RUN_DIR/profile, linked from the report) and
``metrics.wandb`` (an offline W&B run holding metrics.jsonl's rows, continued on resume)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch

from omniscale.errors import UserError
from omniscale.tools.cli import main
from omniscale.tools.report import build_report
from omniscale.tools.train.config import load_config
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from omniscale.tools.train.profiler import StepProfiler, step_profiler
from omniscale.tools.train.trackers import check_trackers, scalars
from tests.tools.train_runs import demo_sets

MISSING = ("metrics.wandb: the wandb package is not installed "
           "(pip install 'omniscale[wandb]')")


def _sets(demo, out, **kw) -> list[str]:
    return demo_sets(demo, out, **{"data.global_batch_tokens": 2048,
                                   "data.micro_batch_tokens": 2048, "optim.decay_steps": 5,
                                   **kw})


def wandb_records(path: Path):
    """The protobuf records of an offline run's ``.wandb`` file (W&B's LevelDB-style log:
    a 7-byte header, 32 KiB blocks of chunks ``crc32 u32, length u16, type u8``; a record is
    one FULL chunk or FIRST, MIDDLE..., LAST)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_history(run: Path) -> tuple[dict, list[dict]]:
    """An offline run directory's (config, history rows without W&B's own ``_`` keys but
    with ``step``)."""
    [log] = run.glob("run-*.wandb")
    config, rows = {}, []
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            rows.append({"step": items.pop("_step"),
                         **{k: v for k, v in items.items() if not k.startswith("_")}})
    return config, rows


def tensorboard_scalars(log_dir: Path) -> dict[tuple[int, str], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    board.Reload()
    return {(e.step, tag): e.value for tag in board.Tags()["scalars"]
            for e in board.Scalars(tag)}


def profiler_steps(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}


def test_profile_and_wandb_then_resume(demo, tmp_path):
    """One short run for both (the suite's time): steps 1-2 of 0-3 profiled, every row in an
    offline W&B run, the report linking the trace; then one more step resumed into the same
    W&B run and, past the window, no new trace."""
    run = tmp_path / "run"
    train("configs/demo_omni.yaml", progress=False, sets=_sets(
        demo, run, steps=4, checkpoint_every=4, **{
            "profile.steps": "[1, 2]",
            "metrics.wandb": "{project: omniscale-test, mode: offline, tags: [ci]}"}))
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]

    traces = sorted((run / "profile").iterdir())
    assert [t.name for t in traces] == ["trace-rank0-steps-1-2.json"]
    assert profiler_steps(traces[0]) == {"ProfilerStep#1", "ProfilerStep#2"}

    run_id = (run / "wandb_id.txt").read_text().strip()
    [offline] = (run / "wandb").glob("offline-run-*")
    assert offline.name.endswith(f"-{run_id}")
    config, history = wandb_history(offline)
    assert config["steps"] == 4 and config["profile"] == {"steps": [1, 2]}
    assert history == [{"step": r["step"], **scalars(r)} for r in rows]
    assert all("loss" in h and any(k.startswith("source_loss/") for k in h) for h in history)
    board = tensorboard_scalars(run / "tensorboard")  # the same names and steps there
    assert board == {(h["step"], k): pytest.approx(v, rel=1e-6) for h in history
                     for k, v in h.items() if k != "step"}

    page = build_report(run).read_text()
    assert "href='../profile/trace-rank0-steps-1-2.json'" in page
    assert "ui.perfetto.dev" in page and "chrome://tracing" in page

    train(None, resume=str(run), sets=["steps=5"], progress=False)
    assert (run / "wandb_id.txt").read_text().strip() == run_id  # the same W&B run
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    [resumed] = [r for r in runs if r != offline]
    assert wandb_history(resumed)[1] == [{"step": 4, **scalars(rows[-1])}]
    assert [t.name for t in (run / "profile").iterdir()] == ["trace-rank0-steps-1-2.json"]


def test_missing_wandb_is_one_line(demo, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails
    sets = _sets(demo, tmp_path / "run", **{"metrics.wandb": "{project: p}"})
    cfg, _ = load_config("configs/demo_omni.yaml", sets)
    with pytest.raises(UserError) as e:
        check_trackers(cfg)
    assert str(e.value) == MISSING
    args = ["train", "configs/demo_omni.yaml", "--no-progress"]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 2
    assert capsys.readouterr().err.strip() == f"omniscale: error: {MISSING}"
    assert not (tmp_path / "run").exists()  # before anything started


def _profiled(run_dir: Path, start: int, first: int, last: int, fail_at: int | None = None):
    """A toy loop of 6 steps from ``start`` under StepProfiler, as tools/train/loop.py runs
    it; returns the traces' names and their ProfilerStep markers."""
    profiler = StepProfiler(first, last, run_dir, 0, torch.device("cpu"), start)
    try:
        for step in range(start, 6):
            torch.randn(32, 32) @ torch.randn(32, 32)
            if step == fail_at:
                raise RuntimeError("a step failed")
            profiler.step(step)
    except RuntimeError:
        pass
    finally:
        profiler.close()
    folder = run_dir / "profile"
    return {t.name: profiler_steps(t) for t in folder.iterdir()} if folder.exists() else {}


@pytest.mark.parametrize("start, fail_at, want", [
    (0, None, {"trace-rank0-steps-2-4.json": {2, 3, 4}}),
    (3, None, {"trace-rank0-steps-3-4.json": {3, 4}}),  # resumed inside: the rest
    (0, 3, {"trace-rank0-steps-2-3.json": {2, 3}}),  # a failed step: as far as it got
    (0, 1, {}),  # failed before the window: nothing recorded, nothing written
])
def test_profiler_window(tmp_path, start, fail_at, want):
    got = _profiled(tmp_path, start, 2, 4, fail_at)
    assert got == {name: {f"ProfilerStep#{s}" for s in steps} for name, steps in want.items()}


def test_no_profiler_unless_asked_or_when_resumed_past_the_window(tmp_path):
    cfg, _ = load_config(None, [])
    assert step_profiler(cfg, tmp_path, 0, torch.device("cpu"), 0) is None
    cfg, _ = load_config(None, ["profile.steps=[1, 2]"])
    assert step_profiler(cfg, tmp_path, 0, torch.device("cpu"), 3) is None
    with pytest.raises(UserError, match="profile.steps: .*first <= last"):
        load_config(None, ["profile.steps=[3, 1]"])


def test_scalars_name_numbers_as_tensorboard_did():
    row = {"step": 7, "loss": 2.5, "tokens": 10, "flag": True, "balance": "omniscale",
           "rank_compute_s": [0.1, 0.2], "source_loss": {"text": 1.5, "bad": None},
           "cost_refit": None}
    assert scalars(row) == {"loss": 2.5, "tokens": 10, "source_loss/text": 1.5}
