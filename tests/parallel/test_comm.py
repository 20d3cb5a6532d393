"""Autograd all-to-all on real gloo processes: forward and backward equal a single-process
reference that moves the same rows by hand, with uneven (and empty) splits, and with equal
splits over a 1-D DeviceMesh."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.multiproc import run_ranks


def _splits(world: int) -> list[list[int]]:
    """splits[i][j]: rows rank i sends to rank j; uneven, some empty."""
    return [[(3 * i + 2 * j + 1) % 4 for j in range(world)] for i in range(world)]


def _data(world: int, D: int = 3):
    g = torch.Generator().manual_seed(7)
    splits = _splits(world)
    xs = [torch.randn(sum(s), D, generator=g, dtype=torch.float64) for s in splits]
    ws = [torch.randn(sum(splits[i][j] for i in range(world)), D, generator=g,
                      dtype=torch.float64) for j in range(world)]
    return splits, xs, ws


def _reference(world: int, rank: int):
    """What rank `rank` should receive, and the gradient of its input rows, by hand."""
    splits, xs, ws = _data(world)
    pieces = [xs[i].split(splits[i]) for i in range(world)]
    out = torch.cat([pieces[i][rank] for i in range(world)])
    grads = []
    for j in range(world):  # my rows sent to j get j's loss weights for them
        offset = sum(splits[i][j] for i in range(rank))
        grads.append(ws[j][offset:offset + splits[rank][j]])
    return out, torch.cat(grads)


def _exchange(rank, world):
    """Uneven splits over the default group, then equal splits over a 1-D DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from omniscale.parallel.comm import all_to_all_single

    splits, xs, ws = _data(world)
    x = xs[rank].clone().requires_grad_()
    out_splits = [splits[i][rank] for i in range(world)]
    out = all_to_all_single(x, out_splits, splits[rank])
    (out * ws[rank]).sum().backward()

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    y = torch.arange(world * 2, dtype=torch.float64).add(100 * rank).requires_grad_()
    y_out = all_to_all_single(y, group=mesh)
    (y_out * (rank + 1)).sum().backward()
    return out.detach(), x.grad, y_out.detach().tolist(), y.grad.tolist()


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_forward_and_backward_are_exact(world):
    results = run_ranks(_exchange, world)
    for rank, (out, grad, y_out, y_grad) in enumerate(results):
        want_out, want_grad = _reference(world, rank)
        assert torch.equal(out, want_out)
        assert torch.equal(grad, want_grad)
        # equal splits: rows 2j, 2j+1 of every rank go to rank j (loss weight j + 1)
        assert y_out == [100.0 * i + 2 * rank + d for i in range(world) for d in (0, 1)]
        assert y_grad == [float(j + 1) for j in range(world) for _ in (0, 1)]
