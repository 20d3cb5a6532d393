"""Gradients across meshes: the global norm and clipping, and whole gradients for debugging.

Encoders, backbone and experts are sharded over different meshes (parallel/mesh.py), so no
single `clip_grad_norm_` call sees them all: the norm is taken per mesh and combined here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omniscale.parallel.dcp import plain_name


def clip_grad_norm(model: torch.nn.Module, clip: float, pp_group=None) -> torch.Tensor:
    """Clip by the global gradient norm. Encoders and backbone are sharded over different
    meshes, so the norm is taken per mesh (each a DTensor reduced to a full scalar) and
    combined, then every gradient is scaled by the same factor. Expert-parallel experts are
    different parameters on each rank of their ep group: their squares are summed over it;
    so are pipeline stages' over `pp_group` (each stage holds its own layers). Returns the
    norm before clipping as a float64 device scalar (reading it would wait for the device)."""
    params = [p for p in model.parameters() if p.grad is not None]
    ep_mesh_of = {id(p): m.ep_mesh for m in model.modules()
                  if getattr(m, "num_global_experts", None) is not None for p in m.parameters()}
    by_mesh: dict = {}
    for p in params:
        key = (getattr(p.grad, "device_mesh", None), ep_mesh_of.get(id(p)))
        by_mesh.setdefault(key, []).append(p)
    squares = []
    for (_, ep_mesh), mesh_params in by_mesh.items():
        grads = [p.grad for p in mesh_params]
        # float64: CPU float32 norms lose ~5e-4 relative on a 1M-element gradient, more than
        # the ranks' sums differ, so 1 and N processes would log different norms of one
        # gradient (a transient float64 copy of one local gradient at a time)
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in grads]),
            2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        square = norm ** 2
        if ep_mesh is not None:
            dist.all_reduce(square, group=ep_mesh.get_group())
        squares.append(square)
    device = next(model.parameters()).device
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64,
                                                                      device=device)
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    # One fused (foreach) scaling per mesh: a foreach kernel takes tensors of one mesh only.
    for mesh_params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(mesh_params, clip, total.float(), foreach=None)
    return total


def full_gradients(model: torch.nn.Module, pp_group=None) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, by name, as float32 CPU tensors (the same on every
    rank). A collective: every rank calls it at the same point. FSDP shards are gathered with
    ``full_tensor()`` on their own mesh; expert-parallel experts (different parameters on each
    rank of their ep group) are concatenated over it, so the names and shapes are those of the
    unsharded model; a pipeline stage's are joined with the other stages' over `pp_group`.
    A parameter without a gradient is left out."""
    ep_of = {id(p): m for m in model.modules()
             if getattr(m, "num_global_experts", None) is not None for p in m.parameters()}
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        experts = ep_of.get(id(p))
        if experts is not None and experts.ep_mesh is not None:
            group = experts.ep_mesh.get_group()
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, grad.contiguous(), group=group)
            grad = torch.cat(parts)
        # names of the plain model (no activation-checkpoint or compile wrapper levels)
        grads[plain_name(name)] = grad.detach().float().cpu()
    if pp_group is not None:
        stages: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, grads, group=pp_group)
        grads = {name: g for stage in stages for name, g in stage.items()}
    return grads
