"""Values for a parallelized model, shard by shard: weights from outside the run (a Hugging
Face checkpoint) and the model's initialisation.

:func:`fill_parameters` walks a module after ``apply_*`` have run: each parameter, by its plain
name (no activation-checkpoint or compile prefixes), is asked of ``read(name, shape,
first_expert)`` -- a full tensor of the parameter's global shape; under expert parallelism the
rank's own experts, from ``Experts.ep_offset`` -- and a DTensor (FSDP, TP) keeps only its own
shard of it. No communication: every rank reads what it needs itself, one tensor at a time,
so a rank's memory peaks at one full tensor beyond its shards.

:func:`init_parameters` does the same with the model's own initialisation: each tensor's full
value is computed on the host by its module's rule (``MoEDecoder.reset_module``, the
encoders') from a generator seeded by (run seed, plain name) -- so the values depend on
neither the layout nor the order of the walk, and one process and N processes start from the
same weights -- and each rank keeps its slice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from omniscale.parallel.dcp import plain_name

Reader = Callable[[str, tuple[int, ...], int], torch.Tensor]
Rule = Callable[[nn.Module], None]  # sets a module's own tensors to their initial values


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


@torch.no_grad()
def init_parameters(module: nn.Module, rule: Rule, seed: int, prefix: str = "",
                    parameters: bool = True) -> None:
    """Every parameter (unless not ``parameters``) and buffer of ``module`` at the value
    ``rule`` gives it in the unsharded model (module docstring). ``rule(child)`` sets
    ``child``'s own tensors; it runs once per tensor, with that tensor a full-size host
    stand-in and the module's other tensors meta stand-ins of their full shapes, after the
    default CPU generator is seeded from ``seed`` and the tensor's name (``prefix`` + plain
    name); callers that care keep their RNG state (``torch.random.fork_rng``). A tensor the
    rule leaves unwritten is an error: the value would be whatever memory held."""
    for module_name, child in module.named_modules():
        tensors = list(child.named_buffers(recurse=False))
        if parameters:
            tensors = list(child.named_parameters(recurse=False)) + tensors
        for name, tensor in tensors:
            path = plain_name(prefix + (f"{module_name}.{name}" if module_name else name))
            full = _initial_value(child, name, rule, _seed(seed, path))
            if full is None:
                raise ValueError(f"{path}: the model's initialisation "
                                 f"({getattr(rule, '__qualname__', rule)}) "
                                 f"does not set it")
            if _experts_dim(child, name):  # expert parallelism: this rank's experts only
                full = full.narrow(0, child.ep_offset, tensor.shape[0])
            copy_into(tensor, full)


def _experts_dim(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is stacked over experts that ``apply_ep`` split (dim 0)."""
    return getattr(module, "num_global_experts", None) is not None and \
        name in module._parameters


def _seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _initial_value(module: nn.Module, name: str, rule: Rule, seed: int) -> torch.Tensor | None:
    """``module.<name>`` as ``rule`` initialises it, whole, on the host (None: not written).
    Every own tensor of ``module`` is swapped for a stand-in of its full shape while the rule
    runs (a rule may read another, as ``nn.Linear``'s bias bound reads the weight's fan-in),
    and restored after."""
    slots = (module._parameters, module._buffers)
    saved = [(slot, n, t) for slot in slots for n, t in slot.items() if t is not None]
    target = None
    try:
        for slot, n, t in saved:
            shape = list(t.shape)
            if _experts_dim(module, n):
                shape[0] = module.num_global_experts
            stand_in = torch.empty(shape, dtype=t.dtype, device="cpu" if n == name else "meta")
            if slot is module._parameters:
                stand_in = nn.Parameter(stand_in, requires_grad=False)
            slot[n] = stand_in
            if n == name:
                target = stand_in
        version = target._version
        torch.default_generator.manual_seed(seed)
        rule(module)
    finally:
        for slot, n, t in saved:
            slot[n] = t
    return target.detach() if target._version != version else None


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """``param`` = ``full``: a DTensor keeps only its own shard of it."""
    if isinstance(param, DTensor):
        # every rank holds the same full tensor: no communication, only the local slice
        local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)
