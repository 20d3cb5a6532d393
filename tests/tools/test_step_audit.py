"""The GPU rules a CPU can prove (tools/train/step_audit.py): a 2-rank step of the omni task
(media encoded on one rank and resharded to another) and of the lm task, with every tensor the
step creates naming its device and every collective handed device tensors; and the step's
host syncs counted within the budget (issue #42: at most 4 per micro-batch outside MoE
dispatch).

The audit itself is checked against hand-made cases first: a tensor made without a device
and handed to a collective is refused; each kind of sync is counted once, host bookkeeping
not at all."""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from omniscale.tools.train.step_audit import StepAudit
from tests.parallel.multiproc import run_ranks
from tests.tools.train_runs import every_source

SYNC_BUDGET = 4  # per micro-batch, outside MoE dispatch (issue #42)


def _implicit_device_collective(rank, world):
    audit = StepAudit("cpu", check_devices=True)
    with audit.compute():
        named = torch.ones(2, device="cpu")
        dist.all_reduce(named)  # names its device: fine
        try:
            dist.all_reduce(torch.ones(2))  # the reshard's old rows_sent
        except RuntimeError as e:
            return float(named[0]), str(e)
    return float(named[0]), None


def test_a_tensor_made_without_a_device_cannot_reach_a_collective():
    for total, error in run_ranks(_implicit_device_collective, 2):
        assert total == 2.0
        assert error is not None and "c10d.allreduce_" in error and "meta tensor" in error


def test_host_syncs_are_counted_on_device_tensors_only():
    weight = torch.nn.Parameter(torch.randn(4))
    model = torch.nn.Module()
    model.weight = weight
    audit = StepAudit("cpu", count_syncs=True)
    host_lengths = torch.tensor([3, 1])
    with audit.compute(model):
        host_lengths.tolist()  # host bookkeeping: free on a GPU too
        int(host_lengths.sum())
        torch.repeat_interleave(torch.arange(2), host_lengths)
        x = weight.detach() * 2  # a device tensor, derived
        float(x.sum())  # _local_scalar_dense
        x.tolist()  # tolist
        torch.nonzero(x > 0)  # nonzero
        x[x > 0]  # boolean index
        device = torch.device("cpu")  # the step's device (a CPU here)
        ids = torch.tensor([0, 1, 1]).to(device)  # moved to the device (blocking: waits)
        torch.ones(2).to(device, non_blocking=True)  # an asynchronous copy: no wait
        torch.bincount(ids)  # bincount
        torch.repeat_interleave(ids, ids)  # no output_size
        torch.repeat_interleave(ids, ids, output_size=2)  # told: no sync
        x.cpu()  # a blocking copy to the host (a no-op on CPU, counted all the same)
        x.to("cpu")  # the same, named
        x.to("cpu", non_blocking=True)  # asynchronous: no wait
        torch.zeros(2, device=device).tolist()  # made on the device: a read
    by_op = collections.Counter()
    for key, n in audit.take().items():  # "op site": count
        by_op[key.split()[0]] += n
    assert by_op == {"_local_scalar_dense": 1, "tolist": 2, "nonzero": 1, "index": 1,
                     "bincount": 1, "repeat_interleave": 1, "cpu": 1, "to(device)": 1,
                     "to(host)": 1}
    assert audit.take() == {}


def _run(demo, tmp_path, task, spec, **extra):
    """Two steps on two ranks with both audits on, as a GPU runs them: the experts grouped
    (torch._grouped_mm, what CUDA's bf16 picks; the CPU's fp32 default loops over experts on
    the host) and selective activation checkpointing (a recompute must not sync again)."""
    sets = {"data.spec": spec, "data.eval_spec": demo / "eval.yaml", "data.workers": 0,
            "steps": 2, "checkpoint_every": 10, "output_dir": tmp_path / task,
            "eval.enabled": False, "optim.warmup_steps": 1, "data.global_batch_tokens": 8192,
            "data.micro_batch_tokens": 4096, "model.overrides.moe.grouped_mm": "grouped",
            "checkpoint.final": False, "parallel.activation_checkpoint": "selective",
            "debug.audit_devices": True, "debug.count_host_syncs": True, **extra}
    train(f"configs/demo_{task}.yaml", nproc=2, sets=[f"{k}={v}" for k, v in sets.items()],
          progress=False)
    # checkpoint.final off and no step a multiple of checkpoint_every: no checkpoint written
    assert not list((tmp_path / task).glob("checkpoints/step-*"))
    return read_metrics(tmp_path / task / "metrics.jsonl")


def _split(row) -> tuple[float, float]:
    """(syncs outside the experts' dispatch, syncs of the dispatch) per micro-batch."""
    dispatch = sum(n for site, n in row["host_syncs"].items() if "parallel.expert:" in site)
    total = sum(row["host_syncs"].values())
    assert total / row["micro_batches"] == row["host_syncs_per_micro_batch"]
    return (total - dispatch) / row["micro_batches"], dispatch / row["micro_batches"]


def test_omni_step_on_two_ranks_names_every_device_and_keeps_the_sync_budget(demo, tmp_path):
    rows = _run(demo, tmp_path, "omni", every_source(demo, tmp_path / "every.yaml"))
    assert [r["step"] for r in rows] == [0, 1]
    assert sum(r["media_items_moved"] for r in rows) > 0  # the reshard moved media
    for row in rows:
        assert _split(row)[0] <= SYNC_BUDGET, row["host_syncs"]
        assert row["host_syncs"], "nothing counted: the reshard reads its split sizes"


def test_lm_step_with_expert_parallelism_keeps_the_sync_budget(demo, tmp_path):
    rows = _run(demo, tmp_path, "lm", demo / "lm.yaml", **{"parallel.ep": 2})
    assert [r["step"] for r in rows] == [0, 1]
    moe_layers = len(rows[0]["expert_load_max_over_mean"])
    for row in rows:
        outside, dispatch = _split(row)
        assert outside <= SYNC_BUDGET, row["host_syncs"]
        assert 0 < dispatch <= moe_layers, row["host_syncs"]  # one per MoE layer at most


def test_sequence_parallel_step_keeps_the_sync_budget(demo, tmp_path):
    """Samples split over an SP pair (Ulysses): the layout reaches the device once per
    micro-batch, without waiting (per layer, blocking, before)."""
    rows = _run(demo, tmp_path, "omni", demo / "mix.yaml", **{
        "parallel.sp": 2, "data.micro_batch_tokens": 256, "data.global_batch_tokens": 4096,
        "data.window": 1})
    assert sum(r["sp_split_samples"] for r in rows) > 0  # samples were split over the pair
    for row in rows:
        assert _split(row)[0] <= SYNC_BUDGET, row["host_syncs"]
        assert not [site for site in row["host_syncs"] if "parallel.sequence:" in site]


def test_pipeline_step_copies_its_micro_batches_without_waiting(demo, tmp_path):
    """Two pipeline stages (lm): each schedule run's stacked micro-batches reach the stage's
    device without a blocking copy (one per tensor per run, before)."""
    rows = _run(demo, tmp_path, "lm", demo / "lm.yaml", **{"parallel.pp": 2})
    for row in rows:
        assert _split(row)[0] <= SYNC_BUDGET, row["host_syncs"]
        assert not [site for site in row["host_syncs"] if site.startswith("to(device)")]
