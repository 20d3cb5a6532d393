"""FSDP2 (`fully_shard`) applied bottom-up to a plain decoder or omni model.

Units, innermost first: each decoder block's routed experts (only when an expert mesh is given:
after `apply_ep` they are sharded over `ep`, so FSDP shards them over `edp_shard` instead),
each decoder block, each encoder block and then each encoder as a whole (patch embedding,
convolutions, projector) on the encoder mesh, and finally the root, which keeps the token
embeddings, final norm and LM head. The model may be a pipeline stage (`apply_pp`'s
`runner.module`: its blocks, keyed by layer index, become units the same way), and may have
been split by `apply_tp` first: FSDP then shards each TP-local parameter over the
data-parallel axes of the same mesh (2-D parameters; the encoders' TP axis is `encoder_tp`). A
unit's parameters are gathered just before its forward
and freed after (or kept, `reshard_after_forward=False`), so peak memory holds one block.

Gradients are **summed** over data-parallel ranks, not averaged: the decoder's loss is a sum
of token losses, and the trainer divides once by the global token count (DESIGN.md), so the
gradient of Σ_ranks loss_rank / N_global is exactly what FSDP's reduction must produce.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from omniscale.parallel.checkpointing import decoder_blocks, encoder_blocks, encoders, unwrap
from omniscale.parallel.mesh import fsdp_mesh

# Root methods a trainer calls instead of forward (OmniModel's two-step API, and the encoder
# call of the trainer's step): FSDP gathers the root's parameters around them as around forward.
ROOT_METHODS = ("encode_media", "encode_items", "decode", "forward_with_media")


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mixed_precision: bool = False,
               reshard_after_forward: bool = True, encoder_mesh: DeviceMesh | None = None,
               expert_mesh: DeviceMesh | None = None, cpu_offload: bool = False) -> nn.Module:
    """Shard `model` in place and return it.

    `mesh`, `encoder_mesh`, `expert_mesh`: the meshes of `ParallelDims.build_mesh` /
    `build_encoder_mesh` / `build_expert_mesh` (FSDP takes their data-parallel axes; HSDP when
    the replicate axis is > 1). Encoders without an `encoder_mesh` join the backbone's units.
    `mixed_precision`: bf16 parameters for compute, fp32 gradient reduction (the sharded
    fp32 parameters stay the optimizer's master weights); on CPU too when asked, though CPU
    matmuls in bf16 are slow. `cpu_offload`: sharded parameters, gradients and optimizer
    state live in host memory (FSDP2's `CPUOffloadPolicy`), copied to the device per unit."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision else MixedPrecisionPolicy()
    dp, kwargs = fsdp_mesh(mesh), {"mp_policy": mp,
                                   "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    units: list[nn.Module] = []

    for block in decoder_blocks(model):
        if expert_mesh is not None and unwrap(block).is_moe:
            experts = unwrap(block).ffn.experts
            units.append(fully_shard(experts, mesh=fsdp_mesh(expert_mesh), **kwargs))
        units.append(fully_shard(block, mesh=dp, **kwargs))

    enc_dp = fsdp_mesh(encoder_mesh) if encoder_mesh is not None else dp
    for encoder in encoders(model):
        for block in encoder_blocks(encoder):
            units.append(fully_shard(block, mesh=enc_dp, **kwargs))
        units.append(fully_shard(encoder, mesh=enc_dp, **kwargs))

    # The root's parameters are needed again at once by backward: keep them gathered.
    units.append(fully_shard(model, mesh=dp, **{**kwargs, "reshard_after_forward": False}))
    for method in ROOT_METHODS:
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
    for unit in units:
        _sum_gradients(unit)
    return model


def _sum_gradients(unit: FSDPModule) -> None:
    """Reduce-scatter / all-reduce with plain SUM (divide factor 1; gloo has no PREMUL_SUM,
    and a factor of 1 needs no scaling anyway): see the module docstring."""
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)
