"""Activation checkpointing per transformer block, and the block lookups the `apply_*` share.

`full`: a block keeps only its input; backward re-runs its forward. `selective`: a block keeps
the outputs of its expensive ops (matmuls, grouped GEMMs, attention, collectives) and re-runs
the cheap ones (norms, rotary, SwiGLU, routing softmax) — most of full AC's memory saving at a
small fraction of its recompute, and collectives are never issued twice (torchtitan's op-level
selective AC). Both are exact: gradients equal those without checkpointing.

Blocks are wrapped in place with `checkpoint_wrapper` (non-reentrant), which leaves state-dict
keys unchanged. Apply after `apply_tp`/`apply_ep` and before `apply_fsdp`, so each FSDP unit is
the wrapped block.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from omniscale.backbone.decoder import Block
from omniscale.backbone.dit import DiTBlock
from omniscale.encoders.audio import AudioEncoder
from omniscale.encoders.block import EncoderBlock
from omniscale.encoders.vision import VisionEncoder

MODES = ("full", "selective")


def unwrap(module: nn.Module) -> nn.Module:
    """The block under an activation-checkpoint wrapper, or the module itself."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def _containers(model: nn.Module) -> list[nn.ModuleList | nn.ModuleDict]:
    """The block containers of `model`: a decoder's `layers` list, an encoder's `blocks`,
    and a pipeline stage's `layers` dict (keyed by layer index, parallel/pipeline.py)."""
    return [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]


def _children(container: nn.ModuleList | nn.ModuleDict) -> list[tuple[int | str, nn.Module]]:
    return list(container.items() if isinstance(container, nn.ModuleDict) else
                enumerate(container))


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """Every decoder block of `model`, as its parent container holds it (wrapped or not)."""
    return [child for m in _containers(model) for _, child in _children(m)
            if isinstance(unwrap(child), Block)]


def encoders(model: nn.Module) -> list[nn.Module]:
    """The vision and audio encoders inside `model`."""
    return [m for m in model.modules() if isinstance(m, (VisionEncoder, AudioEncoder))]


def encoder_blocks(encoder: nn.Module) -> list[nn.Module]:
    return [b for b in encoder.blocks if isinstance(unwrap(b), EncoderBlock)]


def _saved_ops() -> set:
    """Ops whose outputs selective AC keeps (those missing from this build are skipped)."""
    names = [("aten", "mm"), ("aten", "addmm"), ("aten", "bmm"), ("aten", "_grouped_mm"),
             ("aten", "_scaled_dot_product_flash_attention"),
             ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
             ("aten", "_scaled_dot_product_efficient_attention"),
             ("aten", "_scaled_dot_product_cudnn_attention"),
             ("_c10d_functional", "all_reduce"), ("_c10d_functional", "reduce_scatter_tensor"),
             ("_c10d_functional", "all_gather_into_tensor"),
             ("_c10d_functional", "all_to_all_single")]
    ops = set()
    for namespace, name in names:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _selective_context(saved: frozenset):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: nn.Module, mode: str = "full") -> nn.Module:
    """Wrap every decoder, encoder and DiT block of `model` in place; returns `model`."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: choose one of "
                         f"{', '.join(MODES)}")
    kwargs = {"preserve_rng_state": False}  # blocks draw no random numbers
    if mode == "selective":
        kwargs["context_fn"] = partial(_selective_context, frozenset(_saved_ops()))
    for parent in _containers(model):
        for key, child in _children(parent):
            if isinstance(child, (Block, EncoderBlock, DiTBlock)):
                parent[key] = checkpoint_wrapper(child, **kwargs)
    return model
