"""Distributed checkpoints reshard: saved by 4 ranks under FSDP × TP (2 × 2), loaded by 2 ranks
under FSDP alone, every parameter and AdamW state tensor (gathered whole) comes back equal to
the one saved, and training continues with the losses that continuing on 4 ranks gives — the
next step's (model state) and the one after an optimizer step (AdamW state). The same for
expert parallelism: saved by 4 ranks with ep=2 (experts also FSDP-sharded over edp_shard=2),
loaded by 2 ranks with ep=2 and without EP, and by one process."""

from __future__ import annotations

import numpy as np
import pytest

from tests.parallel.dist_models import global_tokens, shard, step_loss
from tests.parallel.multiproc import run_ranks

# One worker runs the module (`--dist loadgroup`): its module fixture, a multi-rank run, is
# built once instead of on each worker that draws one of its tests.
pytestmark = pytest.mark.xdist_group("dcp")


def _train(rank, world, dp_shard, tp, path, save_after, load, seed):
    """Steps with AdamW on a (dp_shard × tp) mesh; returns the global loss of each step run.
    `save_after`: save once that many steps are done; `load`: start from the checkpoint."""
    from omniscale.parallel import ParallelDims, apply_fsdp, apply_tp
    from tests.parallel.dist_models import build

    dims = ParallelDims(dp_shard=dp_shard, tp=tp, world_size=world)
    mesh = dims.build_mesh("cpu")
    model = apply_fsdp(apply_tp(build(seed), mesh["tp"]), mesh)
    return _steps(model, mesh, dims, path, save_after, load)


def _whole_state(model, optimizer) -> dict[str, np.ndarray]:
    """Every parameter and optimizer state tensor, whole, by plain name ("name" and
    "name/exp_avg", ...): DTensors gathered (`full_tensor`), expert-parallel slices (rank i of
    the ep group holds the i-th contiguous block of experts) concatenated over the ep group.
    Collectives: every rank calls it; numpy, as the harness wants."""
    import torch
    import torch.distributed as dist

    ep_groups = {}
    for module in model.modules():
        if getattr(module, "num_global_experts", None) is not None:
            for p in (module.gate_up_proj, module.down_proj):
                ep_groups[p] = (module.ep_mesh.get_group(), module.num_global_experts)

    def whole(t, ep):
        t = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
        if ep is not None and t.dim() > 0:
            group, experts = ep
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts)
            assert t.shape[0] == experts
        return t.numpy().copy()

    out = {}
    for name, p in model.named_parameters():
        name, ep = name.replace("_checkpoint_wrapped_module.", ""), ep_groups.get(p)
        out[name] = whole(p, ep)
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            out[f"{name}/{key}"] = whole(value, ep)
    return out


def _steps(model, mesh, dims, path, save_after, load):
    """Train to step 3 (from the checkpoint at `path` when `load`, saving there after
    `save_after` steps); the global loss of each step run, and the whole state saved and the
    whole state loaded (`_whole_state`, None when not saved / loaded)."""
    import torch
    import torch.distributed as dist

    from omniscale.parallel import load_checkpoint, save_checkpoint
    from tests.parallel.dist_models import sequences

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.zeros((), dtype=torch.long)
    saved = loaded = None
    if load:
        load_checkpoint(path, model, optimizer, extra={"step": step})
        loaded = _whole_state(model, optimizer)
    losses = []
    while int(step) < 3:
        if save_after is not None and int(step) == save_after:
            save_checkpoint(path, model, optimizer, extra={"step": step})
            saved = _whole_state(model, optimizer)
            save_after = None
        seqs = sequences(int(step))
        loss = step_loss(model, shard(seqs, mesh["dp"].get_local_rank(), dims.dp),
                         global_tokens(seqs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach()
        if dims.world_size > 1:
            dist.all_reduce(total, group=mesh["dp_sp"].get_group())
        losses.append((int(step), total.item()))
        step += 1
    return losses, saved, loaded


def _assert_same_state(loaded: dict, saved: dict) -> None:
    """Bit-identical: a checkpoint moves values, it computes nothing."""
    assert loaded.keys() == saved.keys()
    assert {k.split("/")[-1] for k in saved if "/" in k} == {"step", "exp_avg", "exp_avg_sq"}
    for name in saved:
        np.testing.assert_array_equal(loaded[name], saved[name], err_msg=name)


def test_saved_on_4_ranks_loads_on_2_and_continues_alike(tmp_path):
    path = str(tmp_path / "ckpt")
    on_4, saved, _ = run_ranks(_train, 4, 2, 2, path, 1, False, 0)[0]
    on_2, _, loaded = run_ranks(_train, 2, 2, 1, path, None, True, 123)[0]  # load must win
    _assert_same_state(loaded, saved)
    assert [s for s, _ in on_2] == [1, 2]  # the step counter came back too
    assert [loss for _, loss in on_2] == pytest.approx([loss for _, loss in on_4[1:]],
                                                       rel=1e-5)


def _train_ep(rank, world, ep, path, save_after, load, seed):
    """As `_train`, with the MoE layer's experts sharded over `ep` (inside dp_shard = world)."""
    from omniscale.parallel import ParallelDims, apply_ep, apply_fsdp
    from tests.parallel.dist_models import build

    dims = ParallelDims(dp_shard=world, ep=ep, world_size=world)
    mesh, experts = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
    model = build(seed)
    if ep > 1:
        apply_ep(model, experts["ep"])
    if world > 1:
        apply_fsdp(model, mesh, expert_mesh=experts if ep > 1 else None)
    return _steps(model, mesh, dims, path, save_after, load)


@pytest.fixture(scope="module")
def saved_with_ep(tmp_path_factory):
    """A checkpoint saved on 4 ranks with ep=2 after step 1 (read-only for the tests)."""
    path = str(tmp_path_factory.mktemp("ep-ckpt") / "ckpt")
    on_4, saved, _ = run_ranks(_train_ep, 4, 2, path, 1, False, 0)[0]
    return path, on_4, saved


@pytest.mark.parametrize("world,ep", [(2, 2), (2, 1), (1, 1)])
def test_expert_parallel_checkpoint_loads_on_any_layout(saved_with_ep, world, ep):
    path, on_4, saved = saved_with_ep
    again, _, loaded = run_ranks(_train_ep, world, ep, path, None, True, 123)[0]
    _assert_same_state(loaded, saved)
    assert [s for s, _ in again] == [1, 2]
    assert [loss for _, loss in again] == pytest.approx([loss for _, loss in on_4[1:]],
                                                        rel=1e-5)
