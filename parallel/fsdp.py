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

**Frozen parameters** (`requires_grad=False`, set before this runs: the trainer's
`optim.groups`) never share a unit with trained ones, so a unit's flat gradient group holds
trained parameters only. A unit all frozen is kept as it is: FSDP2 gathers it for forward,
and its post-backward finds no gradient and issues no reduce-scatter (nothing reaches it:
its outputs do not require grad, or only through trained parameters elsewhere). A unit that
would mix them is split finer: each frozen sub-module (the largest whose parameters are all
frozen) becomes a unit of its own, before the unit around it, which keeps the trained rest
(a frozen vision tower with a trained projector: the patch embedding gets its own unit). When
one module holds both directly (an expert weight frozen, its sibling trained), the split is
impossible and `MixedUnitError` names the unit and the parameters.

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
from omniscale.parallel.dcp import plain_name
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
    names = {id(p): plain_name(n) for n, p in model.named_parameters()}
    module_names = {id(m): plain_name(n) or "(root)" for n, m in model.named_modules()}

    def shard(module: nn.Module, mesh: DeviceMesh, **options) -> None:
        """`module` as a unit, after a unit of its own for each frozen part it would share
        with trained parameters (module docstring)."""
        for part in frozen_parts(module, is_unit, names, module_names):
            units.append(fully_shard(part, mesh=mesh, **{**kwargs, **options}))
        units.append(fully_shard(module, mesh=mesh, **{**kwargs, **options}))

    for block in decoder_blocks(model):
        if expert_mesh is not None and unwrap(block).is_moe:
            shard(unwrap(block).ffn.experts, fsdp_mesh(expert_mesh))
        shard(block, dp)

    enc_dp = fsdp_mesh(encoder_mesh) if encoder_mesh is not None else dp
    for encoder in encoders(model):
        for block in encoder_blocks(encoder):
            shard(block, enc_dp)
        shard(encoder, enc_dp)

    # The root's parameters are needed again at once by backward: keep them gathered.
    shard(model, dp, reshard_after_forward=False)
    for method in ROOT_METHODS:
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
    for unit in units:
        _sum_gradients(unit)
    return model


class MixedUnitError(ValueError):
    """One module holds frozen and trained parameters directly: no finer unit separates them.
    ``unit``, ``module``, ``frozen``, ``trained``: plain names."""

    def __init__(self, unit: str, module: str, frozen: str, trained: str) -> None:
        super().__init__(f"FSDP unit {unit} would hold frozen {frozen} and trained {trained}, "
                         f"both in module {module} (freeze or train that module whole)")
        self.unit, self.module, self.frozen, self.trained = unit, module, frozen, trained


def is_unit(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _own(module: nn.Module, unit) -> list[nn.Parameter]:
    """The parameters `module`'s unit would hold: its own and its sub-modules', except those
    inside sub-modules that are units already (`unit(m)`)."""
    params = list(module.parameters(recurse=False))
    for child in module.children():
        if not unit(child):
            params += _own(child, unit)
    return params


def frozen_parts(module: nn.Module, unit=is_unit, names: dict | None = None,
                 module_names: dict | None = None) -> list[nn.Module]:
    """The sub-modules of `module` to shard as units of their own, before it, so that its unit
    holds only trained parameters or only frozen ones: the largest all-frozen sub-modules
    wherever the unit would mix them. `unit(m)`: whether sub-module m is a unit already;
    `names`, `module_names`: plain names by `id` (for `MixedUnitError`)."""
    names, module_names = names or {}, module_names or {}

    def name_of(m: nn.Module) -> str:
        return module_names.get(id(m), type(m).__name__)

    def parts(m: nn.Module, own: list[nn.Parameter]) -> list[nn.Module]:
        found = []
        for child in m.children():
            held = [] if unit(child) else _own(child, unit)
            if held and not any(p.requires_grad for p in held):
                found.append(child)
            elif any(not p.requires_grad for p in held):
                found += parts(child, held)
        frozen = [p for p in m.parameters(recurse=False) if not p.requires_grad]
        if frozen:  # the unit's trained rest shares this module with them
            trained = next(p for p in own if p.requires_grad)
            raise MixedUnitError(name_of(module), name_of(m), names.get(id(frozen[0]), "?"),
                                 names.get(id(trained), "?"))
        return found

    own = _own(module, unit)
    if all(p.requires_grad for p in own) or not any(p.requires_grad for p in own):
        return []
    return parts(module, own)


def _sum_gradients(unit: FSDPModule) -> None:
    """Reduce-scatter / all-reduce with plain SUM (divide factor 1; gloo has no PREMUL_SUM,
    and a factor of 1 needs no scaling anyway): see the module docstring."""
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)
