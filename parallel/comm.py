"""Autograd-aware collectives: the only place in parallel/ that moves tensors between ranks.

The `apply_*` logic (expert.py, sequence.py, reshard.py) calls these and never touches
`torch.distributed` collectives itself (picotron's split of logic and communication).

Every all-to-all goes through `all_to_all_single` (gloo has no list form of all-to-all). Its
backward is the reverse all-to-all of the gradients: rows rank i sent to rank j come back
from j as the gradient of those rows. A backward collective runs only when autograd reaches
the op, so every rank must put the op's output into its loss (a `0 * out.sum()` term where a
rank's output is otherwise unused or empty), or the ranks that do reach it wait forever.
It is issued as a functional collective (`_c10d_functional.all_to_all_single`, which returns
its result, then `wait_tensor`; gloo and NCCL run both): selective activation checkpointing
keeps such an op's output, so an all-to-all inside a checkpointed block (the expert dispatch,
Ulysses, encoder TP) runs once, where `dist.all_to_all_single` (which fills a tensor allocated
beforehand) would be issued again by the recompute (parallel/checkpointing.py).

`copy_to_group` is Megatron's "f" (identity forward, gradient all-reduced): the input of a
computation split over a tensor-parallel group, whose ranks each contribute part of its
gradient. `all_reduce_` is the plain in-place reduction of statistics (no gradient).

`group` is a process group or a 1-D DeviceMesh; None means the default (world) group.

Shape suffixes: N rows sent, M rows received, R ranks of the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Group = dist.ProcessGroup | DeviceMesh | None


def process_group(group: Group) -> dist.ProcessGroup:
    """The process group of `group` (a 1-D DeviceMesh's only group, or the world's)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"expected a 1-D DeviceMesh, got dims {group.mesh_dim_names}")
        return group.get_group()
    return group if group is not None else dist.group.WORLD


def group_size(group: Group) -> int:
    return dist.get_world_size(process_group(group))


def group_rank(group: Group) -> int:
    return dist.get_rank(process_group(group))


def _exchange(x_N: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
              pg: dist.ProcessGroup) -> torch.Tensor:
    if in_splits is None:
        R = dist.get_world_size(pg)
        if x_N.shape[0] % R:
            raise ValueError(f"all_to_all_single: {x_N.shape[0]} rows do not split equally "
                             f"over {R} ranks; give the split lists")
        in_splits = out_splits = [x_N.shape[0] // R] * R
    out_M = torch.ops._c10d_functional.all_to_all_single(x_N.contiguous(), out_splits,
                                                         in_splits, pg.group_name)
    return torch.ops._c10d_functional.wait_tensor(out_M)


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_N, out_splits, in_splits, pg):
        ctx.splits, ctx.pg = (out_splits, in_splits), pg
        return _exchange(x_N, out_splits, in_splits, pg)

    @staticmethod
    def backward(ctx, grad_M):
        out_splits, in_splits = ctx.splits
        # The reverse exchange: what we received goes back to where it came from.
        return _exchange(grad_M, in_splits, out_splits, ctx.pg), None, None, None


def all_to_all_single(x_N: torch.Tensor, out_splits: list[int] | None = None,
                      in_splits: list[int] | None = None, group: Group = None) -> torch.Tensor:
    """Differentiable `dist.all_to_all_single` along dim 0.

    `in_splits[j]` rows of `x_N` (in order) go to rank j of the group; `out_splits[j]` rows
    come from rank j. None splits mean equal parts (the row count divisible by the group
    size). Backward sends each received row's gradient back to the rank it came from."""
    pg = process_group(group)
    if (out_splits is None) != (in_splits is None):
        raise ValueError("all_to_all_single: give both split lists or neither")
    if in_splits is not None:
        in_splits, out_splits = [int(n) for n in in_splits], [int(n) for n in out_splits]
        if sum(in_splits) != x_N.shape[0]:
            raise ValueError(f"all_to_all_single: input splits sum to {sum(in_splits)}, "
                             f"input has {x_N.shape[0]} rows")
    return _AllToAllSingle.apply(x_N, out_splits, in_splits, pg)


def exchange_counts(counts_R: torch.Tensor, group: Group = None) -> torch.Tensor:
    """`counts_R[j]` (ints, here) sent to rank j; returns what each rank sent here, [R].
    Not differentiable: split sizes. A `[R, C]` tensor exchanges C counts per rank pair."""
    return _exchange(counts_R, None, None, process_group(group))


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # reduced in place; autograd may hold the original
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


def copy_to_group(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """`x` itself, whose gradient is summed over `group` in backward: each rank uses `x` for
    its own part of a split computation (its heads, its vocabulary rows) and holds only that
    part's gradient."""
    return _CopyToGroup.apply(x, process_group(group))


def all_reduce_(x: torch.Tensor, op: str = "sum", group: Group = None) -> torch.Tensor:
    """In-place all-reduce of `x` ("sum" or "max"), not differentiable: reductions of
    statistics such as a softmax's maximum and normaliser."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    dist.all_reduce(x, op=ops[op], group=process_group(group))
    return x
