"""DTensor arguments for the raw-pointer (Triton) kernels: they must never reach the kernel.

A Triton kernel reads ``data_ptr()`` and assumes a contiguous local layout; a DTensor is a
wrapper whose data is only this rank's shard, and whose reshape may need communication (or be
refused). Under tensor parallelism (parallel/tensor.py) the per-head q/k RMSNorms receive a
head-sharded DTensor ``x_THK`` (``Shard(1)``) and a replicated DTensor weight, so on CUDA the
registry's Triton rms_norm gets DTensors.

``dtensor_safe`` wraps a Triton op: plain tensors go straight to the kernel (one isinstance
per argument); with a DTensor argument it either runs the kernel on the local shards, where
that is the same math (``local``), or calls a torch implementation that DTensor dispatches
op by op (``fallback``: the eager kernel or the reference).

Row-wise ops (RMSNorm over the last dim) are local math when every row tensor is split only
along other dims (``Shard(d)``, d not last) or replicated, and the weight is replicated: each
rank normalises its own rows with the whole weight. Their outputs keep the inputs' placements;
the weight's gradient is this rank's rows' sum, i.e. ``Partial`` over the mesh dims that split
the rows (what DTensor's own reduction gives the eager kernel; the replicated parameter's
gradient is all-reduced from it).

Which Triton ops can receive DTensors under ``apply_tp`` today: only rms_norm (q_norm/k_norm,
``SequenceParallel(sequence_dim=1, use_local_output=True)``). add_rms_norm (block norms), rotary
(after the q/k norms hand back local tensors), swiglu (``ColwiseParallel`` outputs are local),
the MoE permutation (routed experts stay replicated) and linear_cross_entropy (a TP decoder's
loss is ``vocab_parallel_loss``, which calls no kernel) see plain tensors; they are guarded all
the same, so that a future plan cannot silently hand a raw-pointer kernel a DTensor.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
else:  # a torch without distributed support has no DTensors to guard against
    DTensor = None


def has_dtensor(args) -> bool:
    return DTensor is not None and any(isinstance(a, DTensor) for a in args)


def dtensor_safe(fallback: Callable, local: Callable | None = None) -> Callable:
    """Decorator for a raw-pointer op: DTensor arguments go to ``local(kernel, *args)`` (which
    returns NotImplemented where the placements do not allow local math) or else to
    ``fallback(*args)``; the kernel itself only ever sees plain tensors."""

    def wrap(kernel: Callable) -> Callable:
        @functools.wraps(kernel)
        def call(*args, **kwargs):
            if not has_dtensor((*args, *kwargs.values())):
                return kernel(*args, **kwargs)
            if local is not None:
                out = local(kernel, *args, **kwargs)
                if out is not NotImplemented:
                    return out
            return fallback(*args, **kwargs)

        call.raw_kernel = kernel  # undecorated, for tests
        return call

    return wrap


def _splits_rows_only(t: DTensor) -> bool:
    """Every placement leaves the last dim whole: Replicate, or Shard of another dim."""
    last = t.ndim - 1
    return all(p.is_replicate() or (p.is_shard() and p.dim % t.ndim != last)
               for p in t.placements)


def rowwise(n_rows: int) -> Callable:
    """A ``local`` for ops ``(*rows_TD, weight_D, *scalars)`` that act on each row of the last
    dim with the whole weight (rms_norm: 1 row tensor, add_rms_norm: 2)."""

    def local(kernel: Callable, *args, **kwargs):
        if len(args) <= n_rows:  # tensors passed by keyword: left to the fallback
            return NotImplemented
        rows, weight, rest = args[:n_rows], args[n_rows], args[n_rows + 1:]
        first = rows[0]
        if not (isinstance(weight, DTensor) and all(isinstance(r, DTensor) for r in rows)):
            return NotImplemented  # mixed plain/DTensor: DTensor's own rules decide (or refuse)
        mesh, placements = first.device_mesh, first.placements
        if any(r.device_mesh != mesh or r.placements != placements or r.shape != first.shape
               for r in rows) or not _splits_rows_only(first):
            return NotImplemented
        if weight.device_mesh != mesh or not all(p.is_replicate() for p in weight.placements):
            return NotImplemented
        # the weight's gradient from this rank's rows: a partial sum where the rows are split
        grad_placements = [Partial() if isinstance(p, Shard) else Replicate()
                           for p in placements]
        out = kernel(*(r.to_local() for r in rows),
                     weight.to_local(grad_placements=grad_placements), *rest, **kwargs)

        def wrap(y: torch.Tensor) -> DTensor:
            # shape and stride given: a shard of an uneven split is not scaled up by the mesh
            # size; the kernel's outputs are contiguous, so is their global layout
            return DTensor.from_local(y, mesh, placements, run_check=False, shape=first.shape,
                                      stride=_contiguous_strides(first.shape))

        return tuple(wrap(y) for y in out) if isinstance(out, tuple) else wrap(out)

    return local


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
