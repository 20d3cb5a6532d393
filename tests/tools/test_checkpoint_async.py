"""``checkpoint.async_save``: the files are written in the background while training goes on,
and the checkpoint still holds the state of its own step: resuming from it continues bit for
bit as an uninterrupted run."""

from __future__ import annotations

from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import run_omni as _run


def test_async_checkpoint_resumes_bit_for_bit(demo, tmp_path, every_source_one):
    extra, whole, _ = every_source_one  # 4 uninterrupted steps (tests/tools/conftest.py)
    # a checkpoint after every step, written while the next step trains; the newest kept
    _run(demo, tmp_path / "async", 1, steps=3, checkpoint_every=1, **extra,
         **{"checkpoint.async_save": True, "checkpoint.keep_last": 1})
    assert [d.name for d in (tmp_path / "async" / "checkpoints").glob("step-*")] == ["step-000003"]
    assert (tmp_path / "async" / "checkpoints" / "step-000003" / "meta.json").exists()
    result = train(None, resume=str(tmp_path / "async"), sets=["steps=4"], progress=False)
    assert result["start_step"] == 3
    resumed = read_metrics(tmp_path / "async" / "metrics.jsonl")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
