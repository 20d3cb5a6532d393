"""A kill -9 during a checkpoint save (rank 0 of 2 killed after the checkpoint's files are
written, before its ``meta.json``: ``debug.kill_in_save``): the half checkpoint is never the
newest -- ``checkpoints/latest`` still names the one before, and the resume starts there and
trains on to the end."""

from __future__ import annotations

import pytest
from torch.multiprocessing.spawn import ProcessExitedException

from omniscale.tools.train import checkpoint
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import demo_sets


def test_a_kill_during_a_save_resumes_from_the_last_complete_checkpoint(demo, tmp_path):
    run = tmp_path / "run"
    sets = demo_sets(demo, run, **{"data.global_batch_tokens": 4096,
                                   "data.micro_batch_tokens": 2048, "steps": 4,
                                   "checkpoint_every": 2, "debug.kill_in_save": 4})
    with pytest.raises(ProcessExitedException, match="SIGKILL"):
        train("configs/demo_omni.yaml", nproc=2, progress=False, sets=sets)
    half = run / "checkpoints" / "step-000004"
    assert half.is_dir() and any(half.iterdir()) and not (half / "meta.json").exists()
    assert (run / "checkpoints" / "latest").read_text() == "step-000002\n"
    assert checkpoint.latest(run) == (2, run / "checkpoints" / "step-000002")

    result = train(None, nproc=2, resume=str(run), sets=["debug.kill_in_save=null"],
                   progress=False)
    assert result["start_step"] == 2
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2, 3]
    assert (half / "meta.json").is_file()
    assert (run / "checkpoints" / "latest").read_text() == "step-000004\n"
