"""Ranks that would disagree on whether a checkpoint verifies reach one decision (issue #46,
item 4): ``checkpoint.verify`` splits the manifest's files over the ranks, so a damaged file
is seen by the one rank that hashes it -- and every rank must refuse alike, with that rank's
line, or every rank loads the same intact checkpoint. None goes on alone (into DCP, waiting for
a peer that stopped, or loading a step its peers refused).

One real run of 2 gloo processes (``tests.parallel.multiproc.run_ranks``) saves two real
2-rank checkpoints (DCP: ``.metadata`` and one shard per rank) and damages them between
verdicts; each rank reports what it decided."""

from __future__ import annotations

import torch
import torch.distributed as dist

from omniscale.errors import UserError
from omniscale.tools.train import checkpoint
from tests.parallel.multiproc import run_ranks

# With 2 ranks, the sorted manifest [.metadata, __0_0.distcp, __1_0.distcp] is split as
# rank 0: .metadata and __1_0.distcp; rank 1: __0_0.distcp.
SEEN_BY_RANK_1_ONLY = "__0_0.distcp"
SEEN_BY_RANK_0_ONLY = "__1_0.distcp"


class _Plane:
    """The plane's part in a save: rank 0 asks it for its snapshot of the step."""

    def snapshot(self, step: int) -> dict:
        return {"path": f"plane/snap-{step}.json"}


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _verdict(path) -> str | None:
    try:
        checkpoint.verify(path)
    except UserError as e:
        return str(e)
    return None


def _decisions(rank: int, world: int, run_dir) -> dict:
    """Every rank: save steps 1 and 2, damage one file of step 2 that only rank 1 hashes,
    verify both, load the one that verifies; then damage one file of step 1 that only rank 0
    hashes, and verify it again."""
    model, optimizer = _model()
    saved = {}
    for step in (1, 2):
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
        saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        checkpoint.save(run_dir, step, model, optimizer, _Plane(), rank)
    one, two = checkpoint.checkpoint_dir(run_dir, 1), checkpoint.checkpoint_dir(run_dir, 2)
    if rank == 0:
        _flip(two / SEEN_BY_RANK_1_ONLY)
    dist.barrier()
    out = {"newest": _verdict(two), "older": _verdict(one)}
    fresh, fresh_optimizer = _model()
    out["loaded_step"] = checkpoint.load(one, fresh, fresh_optimizer, verified=True)
    out["loaded_equal"] = all(torch.equal(v, saved[1][k]) for k, v in fresh.state_dict().items())
    dist.barrier()
    if rank == 0:
        _flip(one / SEEN_BY_RANK_0_ONLY)
    dist.barrier()
    out["older_damaged"] = _verdict(one)
    return out


def test_ranks_that_see_different_damage_decide_alike(tmp_path):
    rank0, rank1 = run_ranks(_decisions, 2, tmp_path / "run")
    run = tmp_path / "run" / "checkpoints"
    # step 2: only rank 1 hashed the damaged shard; both refuse, with its line
    newest = f"{run / 'step-000002'}: {SEEN_BY_RANK_1_ONLY}: checksum does not match"
    assert rank0["newest"] == rank1["newest"] and rank0["newest"].startswith(newest)
    # step 1 verifies on both and both load it, the same parameters as saved
    assert rank0["older"] is None and rank1["older"] is None
    assert rank0["loaded_step"] == rank1["loaded_step"] == 1
    assert rank0["loaded_equal"] and rank1["loaded_equal"]
    # damage only rank 0 hashes: both refuse, with rank 0's line
    older = f"{run / 'step-000001'}: {SEEN_BY_RANK_0_ONLY}: checksum does not match"
    assert rank0["older_damaged"] == rank1["older_damaged"]
    assert rank1["older_damaged"].startswith(older)
