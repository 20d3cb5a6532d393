"""Activation checkpointing per transformer block, and the block lookups the `apply_*` share.

`full`: a block keeps only its input; backward re-runs its forward. `selective`: a block keeps
the outputs of its expensive ops (matmuls, grouped GEMMs, attention, collectives) and re-runs
the cheap ones (norms, rotary, SwiGLU, routing softmax) — most of full AC's memory saving at a
small fraction of its recompute, and collectives are never issued twice (torchtitan's op-level
selective AC). Both are exact: gradients equal those without checkpointing.

What selective AC sees is the dispatcher's ops, so an op is kept only if it is one op there:
- attention: every backend the registry can choose is one op (SDPA's fused kernels; the
  `varlen_attn` custom op; flash-attn's custom ops; flex attention's HOP when it runs eagerly),
  except the CPU "blocked" backend, an autograd.Function of batched matmuls: its score and
  output products (`baddbmm`, `bmm`) are kept and only its softmax is recomputed, from the
  kept scores (which take the place of the probabilities it would keep without AC). Flex
  attention compiled (kernels/flex.py on CUDA) is compiled as one wrapped region
  (`higher_order::inductor_compiled_code`, kernels.flex.compile_as_one_op): kept too.
- the Triton kernels (norms, rotary, SwiGLU, MoE permutes) are autograd.Functions whose
  launches no dispatch mode sees: they re-run whole, which is what selective AC wants for
  memory-bound ops. Allocation ops (`empty_like`) are never kept, since a kernel writes into
  their outputs behind the version counter's back.
- collectives are kept only in functional form (`_c10d_functional`, which returns its
  result): that is why parallel/comm.py's all-to-alls (expert dispatch, Ulysses, encoder TP)
  go through functional collectives; DTensor's are functional already.
- every matmul is kept (torchtitan keeps every other `mm` to save memory; nothing measured
  here says to trade that recompute for memory).

Ops are named ("namespace::name", any functional overload) rather than looked up when `apply_ac`
runs, as some register only when their library is imported (kernels/flash.py imports flash_attn
at its first call).

Blocks are wrapped in place with `checkpoint_wrapper` (non-reentrant), which leaves state-dict
keys unchanged. Apply after `apply_tp`/`apply_ep` and before `apply_fsdp`, so each FSDP unit is
the wrapped block.
"""

from __future__ import annotations

import functools

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

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")
ATTENTION = (
    # SDPA's fused kernels (the reference backend, and long runs of the blocked one)
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    # torch.nn.attention.varlen.varlen_attn: one custom op over flash (or cuDNN) forward;
    # the aten ops under it, for a backend calling them directly
    "torch_attn::_varlen_attn",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "aten::_cudnn_attention_forward",
    # flash-attn 2's custom ops (kernels/flash.py)
    "flash_attn::_flash_attn_varlen_forward",
    "flash_attn::_flash_attn_forward",
    # flex attention run eagerly; compiled (the CUDA fallback), its region is one op
    # (kernels.flex.compile_as_one_op)
    "higher_order::flex_attention",
    "higher_order::inductor_compiled_code",
)
COLLECTIVES = ("_c10d_functional::all_reduce", "_c10d_functional::reduce_scatter_tensor",
               "_c10d_functional::all_gather_into_tensor",
               "_c10d_functional::all_to_all_single")
SAVED = frozenset(MATMULS + ATTENTION + COLLECTIVES)


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


def op_name(op) -> str:
    """"namespace::name" of a dispatcher op (any overload) or a higher-order op."""
    name = op.name()
    return name if "::" in name else f"{op.namespace}::{name}"


@functools.lru_cache(maxsize=None)  # the policy asks once per op call; ops are few
def selective_saves(op) -> bool:
    """Whether selective AC keeps the output of `op` (an OpOverload or a HOP). Never an
    overload that writes into a tensor it is given (`mm.out`, as compiled code calls it): its
    caller reads that tensor, not the output a kept op hands back in the recompute."""
    if isinstance(op, torch._ops.OpOverload) and op._schema.is_mutable:
        return False
    return op_name(op) in SAVED


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if selective_saves(op) else \
        CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str = "full") -> nn.Module:
    """Wrap every decoder, encoder and DiT block of `model` in place; returns `model`."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: choose one of "
                         f"{', '.join(MODES)}")
    kwargs = {"preserve_rng_state": False}  # blocks draw no random numbers
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _policy)
    for parent in _containers(model):
        for key, child in _children(parent):
            if isinstance(child, (Block, EncoderBlock, DiTBlock)):
                parent[key] = checkpoint_wrapper(child, **kwargs)
    return model
