"""Weights from outside the run (a Hugging Face checkpoint) into a parallelized model.

:func:`fill_parameters` walks a module after ``apply_*`` have run: each parameter, by its plain
name (no activation-checkpoint or compile prefixes), is asked of ``read(name, shape,
first_expert)`` -- a full tensor of the parameter's global shape; under expert parallelism the
rank's own experts, from ``Experts.ep_offset`` -- and a DTensor (FSDP, TP) keeps only its own
shard of it. No communication: every rank reads what it needs itself, one tensor at a time,
so a rank's memory peaks at one full tensor beyond its shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from omniscale.parallel.dcp import plain_name

Reader = Callable[[str, tuple[int, ...], int], torch.Tensor]


@torch.no_grad()
def fill_parameters(module: nn.Module, read: Reader, buffers: bool = False) -> None:
    """Every parameter of ``module`` from ``read`` (module docstring), and every persistent
    buffer too when ``buffers`` (buffers are never sharded). ``read`` may answer None: the
    tensor keeps its value (a projection the checkpoint does not have)."""
    for module_name, child in module.named_modules():
        first = getattr(child, "ep_offset", 0)
        tensors = list(child.named_parameters(recurse=False))
        if buffers:
            tensors += [(n, b) for n, b in child.named_buffers(recurse=False)
                        if n not in child._non_persistent_buffers_set]
        for name, tensor in tensors:
            full = read(plain_name(f"{module_name}.{name}" if module_name else name),
                        tuple(tensor.shape), first)
            if full is not None:
                copy_into(tensor, full)


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """``param`` = ``full``: a DTensor keeps only its own shard of it."""
    if isinstance(param, DTensor):
        # every rank holds the same full tensor: no communication, only the local slice
        local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)
