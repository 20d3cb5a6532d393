"""Tensor parallelism (Megatron-style, DTensor `parallelize_module`) for the decoder blocks.

Per block: q/k/v projections column-wise (each TP rank owns a contiguous slice of query heads
and of kv heads; SDPA pairs query head h with kv head h·G/H, so contiguous slices stay matched)
and the output projection row-wise (one all-reduce); the dense SwiGLU and the MoE's shared expert
gate/up column-wise and down row-wise. Only head and feature dimensions are split, so a packed
varlen micro-batch keeps its whole token dimension and `cu_seqlens` on every TP rank.

The per-head q/k RMSNorms (Qwen3) run on this rank's heads only, so their shared weight becomes
a replicated DTensor over a head-sharded input, whose gradient DTensor all-reduces (torchtitan's
`SequenceParallel(sequence_dim=heads)` trick); on GPU this needs an rms_norm kernel that accepts
DTensors (the torch reference does).

Left replicated on every TP rank: the block norms, the router and the routed experts (expert
parallelism shards those: `apply_ep`), the embeddings and the LM head (the fused linear
cross-entropy needs the whole vocabulary row), and the encoders (they run in their own groups).
These see identical inputs and output gradients on every TP rank (column-wise layers all-reduce
their input gradient), so their gradients agree without communication.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from parallel.checkpointing import decoder_blocks, unwrap

# q/k norms act per head on [T, heads, K]: their one weight sees only this rank's heads, so it
# is a replicated DTensor over a head-sharded input (its gradient is then all-reduced).
HEAD_NORM = partial(SequenceParallel, sequence_dim=1, use_local_output=True)
ATTENTION_PLAN = {"q_proj": ColwiseParallel, "k_proj": ColwiseParallel,
                  "v_proj": ColwiseParallel, "o_proj": RowwiseParallel,
                  "q_norm": HEAD_NORM, "k_norm": HEAD_NORM}
SWIGLU_PLAN = {"gate_proj": ColwiseParallel, "up_proj": ColwiseParallel,
               "down_proj": RowwiseParallel}


def _plan(prefix: str, styles: dict) -> dict:
    return {f"{prefix}.{name}": style() for name, style in styles.items()}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split every decoder block of `model` over the 1-D `tp_mesh` (`mesh["tp"]`), in place.

    Apply before `apply_ac` and `apply_fsdp` (torchtitan's order). The attention modules'
    head counts become per-rank counts, since their reshapes see local tensors."""
    tp = tp_mesh.size()
    if tp == 1:
        return model
    for wrapped in decoder_blocks(model):
        block = unwrap(wrapped)
        attn = block.attn
        if attn.n_heads % tp or attn.n_kv_heads % tp:
            raise ValueError(f"tp={tp}: must divide n_heads={attn.n_heads} and "
                             f"n_kv_heads={attn.n_kv_heads}")
        plan = _plan("attn", {k: v for k, v in ATTENTION_PLAN.items()
                              if getattr(attn, k, None) is not None})
        if not block.is_moe:
            plan |= _plan("ffn", SWIGLU_PLAN)
        elif block.ffn.shared_expert is not None:
            plan |= _plan("ffn.shared_expert", SWIGLU_PLAN)
        parallelize_module(block, tp_mesh, plan)
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
    return model
