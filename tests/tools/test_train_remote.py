"""A training run whose sources are in an object store (the local S3 server): it trains from
the bucket through the node cache, and each row says what the store and the cache served.
(That the batches equal the local copy's: tests/loaders/test_remote_pipeline.py.)"""

from __future__ import annotations

import math

import pytest

from omniscale.tools.data_copy import copy_specs
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from tests.s3_fixtures import new_bucket, s3_fixture, s3_server_fixture  # noqa: F401


def run(spec, out, **extra):
    sets = {"data.spec": spec, "data.eval_spec": "null", "data.workers": 1,
            "data.global_batch_tokens": 8192, "data.micro_batch_tokens": 4096,
            "optim.warmup_steps": 1, "optim.decay_steps": 4, "eval.enabled": False,
            "output_dir": out, "steps": 2, "data.refit_costs_every": 0, **extra}
    train("configs/demo_omni.yaml", nproc=1, sets=[f"{k}={v}" for k, v in sets.items()],
          progress=False)
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.timeout(300)
def test_training_from_a_bucket_reports_its_reads(demo_root, s3, tmp_path):
    bucket = new_bucket(s3, "train")
    remote, = copy_specs([demo_root / "mix.yaml"], f"s3://{bucket}/demo", s3.storage_options,
                         progress=False, out_dir=tmp_path)
    rows = run(remote, tmp_path / "remote", **{"data.cache_dir": tmp_path / "cache"})
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert math.isfinite(row["loss"]) and row["tokens"] > 0
        io = row["data_io"]
        assert io["cache_hits"] + io["cache_misses"] > 0
        assert 0 <= io["cache_hit_rate"] <= 1
    # the plans' prefetch fetched ahead: the workers found (most of) their blocks cached
    assert sum(r["data_io"]["cache_hits"] for r in rows) > 0
    assert any(r["data_io"]["store_bytes_per_sample"] >= 0 for r in rows)
