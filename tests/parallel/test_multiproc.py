"""The multi-process harness itself: real gloo collectives across spawned ranks."""

from __future__ import annotations

import pytest

from tests.parallel.multiproc import run_ranks


def _all_reduce(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one broke")
    return rank


def _tensor(rank, world):
    import torch

    return {"grad": torch.full((3,), float(rank))}


def test_all_reduce_over_real_processes():
    assert run_ranks(_all_reduce, 2) == [3.0, 3.0]


def test_tensors_come_back_intact():
    out = run_ranks(_tensor, 2)
    assert [o["grad"].tolist() for o in out] == [[0.0] * 3, [1.0] * 3]


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(AssertionError, match="(?s)rank 1:.*ValueError: rank one broke"):
        run_ranks(_fail_on_one, 2, timeout=60)
