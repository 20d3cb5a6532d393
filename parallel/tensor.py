"""Tensor parallelism (Megatron-style, DTensor `parallelize_module`): decoder blocks, the token
embeddings and LM head, and (over their own mesh) the encoders' blocks.

Decoder blocks: q/k/v projections column-wise (each TP rank owns a contiguous slice of query
heads and of kv heads; SDPA pairs query head h with kv head h·G/H, so contiguous slices stay
matched) and the output projection row-wise (one all-reduce); the dense SwiGLU and the MoE's
shared expert gate/up column-wise and down row-wise. Only head and feature dimensions are
split, so a packed varlen micro-batch keeps its whole token dimension and `cu_seqlens` on every
TP rank. The per-head q/k RMSNorms (Qwen3) run on this rank's heads only, so their shared weight
becomes a replicated DTensor over a head-sharded input, whose gradient DTensor all-reduces
(torchtitan's `SequenceParallel(sequence_dim=heads)` trick); the Triton RMSNorm runs on the
local heads (`kernels/dtensor.py`).

Embeddings and LM head: both weights are split over the vocabulary (`Shard(0)`). The lookup is
row-wise (each rank embeds the ids in its vocabulary range, one all-reduce). The model's loss
reads the LM head's weight directly (a fused linear cross-entropy, never a `lm_head(x)` call),
so `apply_tp` gives the decoder a vocabulary-parallel `loss` (and `logits`), which a pipeline's
last stage uses too: chunk by chunk of tokens, each rank scores its [C, V/tp] logits and the
softmax's maximum, normaliser and target logit are all-reduced — neither the full [T, V] logits
nor a rank's [T, V/tp] ever exist. Tied embeddings share the one split weight.

Encoders (only with `encoder_tp_mesh`): their blocks fuse projections — `qkv` rows are
[q | k | v] and `gate_up` rows [gate | up] — so a contiguous `Shard(0)` of the weight (the
layout checkpoints and FSDP see, identical to the unsplit model's) gives rank r rows that are
not aligned with heads or SwiGLU pairs. Each forward therefore regroups the weight shards with
one all-to-all over the TP group into [q_r | k_r | v_r] (and [gate_r | up_r]): traffic is
proportional to the weights, like an FSDP all-gather, not to the tokens (an encoder micro-batch
holds far more patches than it has channels). Backward sends gradient rows back the same way.
`out` and `down` are plain row-wise layers.

Left replicated on every TP rank: the block norms, the router and the routed experts (expert
parallelism shards those: `apply_ep`), the final norm, the encoders' patch embedding,
convolutions and projectors. These see identical inputs and output gradients on every TP rank
(column-wise layers and the loss all-reduce their input gradient), so their gradients agree
without communication.

Shape suffixes: T tokens, D width, V vocabulary, v this rank's vocabulary rows, R weight rows,
C weight columns (+1 for the bias; in the loss, tokens of a chunk).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from omniscale.backbone.decoder import MoEDecoder
from omniscale.kernels.fused import addmm_wide_, default_chunk, mm_wide
from omniscale.layout import IGNORE_INDEX
from omniscale.parallel.checkpointing import decoder_blocks, encoder_blocks, encoders, unwrap
from omniscale.parallel.comm import all_reduce_, all_to_all_single, copy_to_group

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


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh,
             encoder_tp_mesh: DeviceMesh | None = None) -> nn.Module:
    """Split `model` over the 1-D `tp_mesh` (`mesh["tp"]`), in place: every decoder block,
    and the token embeddings and LM head of every `MoEDecoder` or pipeline stage
    (`apply_pp`'s `runner.module`) in it. Encoders are split only
    over `encoder_tp_mesh` (`encoder_mesh["encoder_tp"]`), since they run in their own groups;
    left out, they stay replicated as before.

    Apply before `apply_ac` and `apply_fsdp` (torchtitan's order). The attention modules'
    head counts become per-rank counts, since their reshapes see local tensors."""
    tp = tp_mesh.size()
    if tp > 1:
        for wrapped in decoder_blocks(model):
            _split_decoder_block(unwrap(wrapped), tp_mesh)
        from omniscale.parallel.pipeline import DecoderStage  # here: pipeline imports this module

        for decoder in [m for m in model.modules() if isinstance(m, (MoEDecoder, DecoderStage))]:
            _split_vocabulary(decoder, tp_mesh)
    if encoder_tp_mesh is not None and encoder_tp_mesh.size() > 1:
        for encoder in encoders(model):
            for wrapped in encoder_blocks(encoder):
                _split_encoder_block(unwrap(wrapped), encoder_tp_mesh)
    return model


# ---- decoder blocks ------------------------------------------------------------------------

def _split_decoder_block(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    tp, attn = tp_mesh.size(), block.attn
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


# ---- embeddings and LM head ----------------------------------------------------------------

def _split_vocabulary(decoder: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A decoder's, or a pipeline stage's (which may hold either or neither), embeddings and
    LM head; a stage's `loss` already handles a split weight."""
    plan = {}
    if decoder.embed_tokens is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(),
                                               output_layouts=Replicate())
    if decoder.lm_head is not None:  # a direct lm_head(x) call still gets whole logits
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    if plan:
        parallelize_module(decoder, tp_mesh, plan)
    if not isinstance(decoder, MoEDecoder):
        return
    # Instance attributes shadow the methods, as FSDP's register_fsdp_forward_method does:
    # every caller (the omni model, a trainer, an evaluator) keeps calling decoder.loss.
    decoder.loss = partial(_decoder_loss, decoder)
    decoder.logits = partial(_decoder_logits, decoder)


def _decoder_loss(decoder: MoEDecoder, hidden_TD: torch.Tensor, labels_T: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`MoEDecoder.loss` with the LM head split over the vocabulary."""
    loss = vocab_parallel_loss(decoder.lm_weight_VD, hidden_TD, labels_T)
    return loss, (labels_T != IGNORE_INDEX).sum()


def _decoder_logits(decoder: MoEDecoder, hidden_TD: torch.Tensor) -> torch.Tensor:
    """`MoEDecoder.logits` with the LM head split over the vocabulary: whole [T, V] logits
    (gathered; for evaluation, not for the loss)."""
    weight_VD = decoder.lm_weight_VD
    weight_vD, _ = _vocab_shard(weight_VD)
    local_Tv = copy_to_group(hidden_TD, weight_VD.device_mesh) @ weight_vD.T
    T, V = hidden_TD.shape[0], weight_VD.shape[0]
    return DTensor.from_local(local_Tv, weight_VD.device_mesh, [Shard(1)], shape=(T, V),
                              stride=(V, 1)).full_tensor()


def _vocab_shard(weight_VD: DTensor) -> tuple[torch.Tensor, int]:
    """(this rank's rows of a vocabulary weight split `Shard(0)` over a 1-D TP mesh, the first
    vocabulary id they hold): `Shard` splits like `torch.chunk`, ceil(V / tp) rows a rank."""
    mesh, V = weight_VD.device_mesh, weight_VD.shape[0]
    if mesh.ndim != 1 or weight_VD.placements != (Shard(0),):
        raise ValueError(f"vocabulary-parallel loss: expected the LM weight split Shard(0) over "
                         f"a 1-D TP mesh, got {weight_VD.placements} over "
                         f"{mesh.mesh_dim_names}")
    tp = mesh.size()
    if -(-V // tp) * (tp - 1) >= V:
        raise ValueError(f"tp={tp}: vocab_size={V} leaves a TP rank without vocabulary rows")
    return weight_VD.to_local(), mesh.get_local_rank() * -(-V // tp)


def vocab_parallel_loss(weight_VD: DTensor, hidden_TD: torch.Tensor, labels_T: torch.Tensor,
                        chunk: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of `hidden_TD @ weight_VD.T` (labels already shifted,
    IGNORE_INDEX ignored) for an LM weight split over the vocabulary by `apply_tp`; the same
    value on every TP rank. Used by the decoder's `loss` and by a pipeline's last stage.

    Computed `chunk` tokens at a time (default: kernels/fused.py's, for the largest rank's
    share of the vocabulary), so no [T, V/tp] tensor exists. The head computes in its
    weight's dtype and the softmax in fp32, as `MoEDecoder.loss` does."""
    weight_vD, lo = _vocab_shard(weight_VD)
    mesh = weight_VD.device_mesh
    # Every TP rank must cut the same chunks (their all-reduces pair up), and the last rank's
    # slice of an uneven vocabulary is shorter: the chunk follows the largest slice.
    chunk = chunk or default_chunk(hidden_TD.device, -(-weight_VD.shape[0] // mesh.size()))
    hidden_TD = copy_to_group(hidden_TD.to(weight_vD.dtype), mesh)  # each rank: part of its grad
    # under no_grad (evaluation) the forward skips the gradients it would otherwise accumulate
    return _VocabParallelCrossEntropy.apply(hidden_TD, weight_vD,
                                            labels_T.to(hidden_TD.device), lo,
                                            mesh.get_group(), chunk, torch.is_grad_enabled())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Σ_t cross-entropy of `hidden_TD @ weight_vD.T`, this rank's vocabulary rows of the
    logits (Megatron's vocab-parallel CE): log Σ_V exp(z) − z[label], from the per-token
    maximum, normaliser and target logit all-reduced over the TP group. Labels outside this
    rank's range (or ignored) contribute no target logit here.

    In chunks of C tokens, as kernels/fused.py: a chunk's [C, v] logits become, in place, their
    softmax and then d loss / d logits = softmax − one-hot(label), from which the gradients
    w.r.t. hidden and this rank's weight rows are accumulated in the forward already; backward
    only scales them (no communication: `copy_to_group` sums the hidden gradient). Peak: one
    chunk's logits, plus dW (fp32) and dH, instead of [T, v] logits, exponentials and softmax."""

    @staticmethod
    def forward(ctx, hidden_TD, weight_vD, labels_T, lo, pg, chunk, grad_enabled):
        ctx.dtypes = hidden_TD.dtype, weight_vD.dtype
        T, v = hidden_TD.shape[0], weight_vD.shape[0]
        acc = torch.promote_types(weight_vD.dtype, torch.float32)  # softmax: fp32 (or fp64)
        loss = torch.zeros((), dtype=acc, device=hidden_TD.device)
        d_hidden = torch.empty_like(hidden_TD) \
            if grad_enabled and ctx.needs_input_grad[0] else None
        d_weight = torch.zeros(v, hidden_TD.shape[1], dtype=acc, device=weight_vD.device) \
            if grad_enabled and ctx.needs_input_grad[1] else None
        want_grad = d_hidden is not None or d_weight is not None
        for start in range(0, T, chunk):
            rows = slice(start, start + chunk)
            h_CD, labels_C = hidden_TD[rows], labels_T[rows]
            # in the compute dtype (bf16 under mixed precision), written in fp32
            logits_Cv = mm_wide(h_CD, weight_vD.T, hidden_TD.new_empty(h_CD.shape[0], v,
                                                                         dtype=acc))
            max_C = all_reduce_(logits_Cv.amax(-1), "max", pg)
            valid_C = labels_C != IGNORE_INDEX
            local_C = labels_C - lo
            here_C = valid_C & (local_C >= 0) & (local_C < v)
            index_C1 = local_C.clamp(0, v - 1)[:, None]
            target_C = torch.where(here_C, logits_Cv.gather(1, index_C1)[:, 0] - max_C, 0.0)
            exp_Cv = logits_Cv.sub_(max_C[:, None]).exp_()
            # the normaliser and the target logit in one all-reduce
            sum_C, target_C = all_reduce_(torch.stack([exp_Cv.sum(-1), target_C]), "sum", pg)
            loss += torch.where(valid_C, sum_C.log() - target_C, 0.0).sum()
            if want_grad:
                grad_Cv = exp_Cv.div_(sum_C[:, None])
                grad_Cv.scatter_add_(1, index_C1, -here_C[:, None].to(acc))
                grad_Cv.mul_(valid_C[:, None])
                grad_Cv = grad_Cv.to(weight_vD.dtype)  # both matmuls in the compute dtype
                if d_hidden is not None:
                    torch.mm(grad_Cv, weight_vD, out=d_hidden[rows])
                if d_weight is not None:  # accumulated in fp32 across chunks
                    addmm_wide_(d_weight, grad_Cv.T, h_CD)
                del grad_Cv
            del logits_Cv, exp_Cv  # before the next chunk's logits are allocated
        ctx.save_for_backward(d_hidden, d_weight)
        return loss

    @staticmethod
    def backward(ctx, grad):
        d_hidden, d_weight = ctx.saved_tensors
        dh = None if d_hidden is None else (d_hidden * grad.to(d_hidden.dtype)
                                            ).to(ctx.dtypes[0])
        dw = None if d_weight is None else (d_weight * grad).to(ctx.dtypes[1])
        return dh, dw, None, None, None, None, None


# ---- encoder blocks ------------------------------------------------------------------------

def _split_encoder_block(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    tp = tp_mesh.size()
    ffn_dim = block.down.in_features
    if block.n_heads % tp or ffn_dim % tp:
        raise ValueError(f"encoder_tp={tp}: must divide the encoder's n_heads={block.n_heads} "
                         f"and ffn_dim={ffn_dim}")
    _fused_colwise(block.qkv, tp_mesh, parts=3)
    plan = {"out": RowwiseParallel(), "down": RowwiseParallel()}
    if getattr(block, "gate_up", None) is not None:  # SwiGLU
        _fused_colwise(block.gate_up, tp_mesh, parts=2)
    else:  # fc1 -> activation -> fc2 (the Qwen2-VL and Whisper layouts)
        plan["up"] = ColwiseParallel()
    parallelize_module(block, tp_mesh, plan)
    block.n_heads //= tp


def _fused_colwise(linear: nn.Linear, tp_mesh: DeviceMesh, parts: int) -> None:
    """Split a linear layer whose output rows are `parts` equal blocks (q|k|v, gate|up)
    column-wise, keeping a contiguous `Shard(0)` weight; its forward computes block-aligned
    rows [part_0 of rank r | part_1 of rank r | …] (module docstring)."""
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    rows = linear.out_features
    width, share = rows // parts, rows // parts // tp
    for name in ("weight", "bias"):
        p = getattr(linear, name)
        if p is not None:
            setattr(linear, name, nn.Parameter(distribute_tensor(p.data, tp_mesh, [Shard(0)]),
                                               requires_grad=p.requires_grad))

    def dest_of(global_R: torch.Tensor) -> torch.Tensor:
        return global_R % width // share  # the TP rank whose block-aligned rows hold it

    held_R = torch.arange(rank * rows // tp, (rank + 1) * rows // tp)
    send_order_R = torch.argsort(dest_of(held_R), stable=True)
    in_splits = torch.bincount(dest_of(held_R), minlength=tp).tolist()
    # From each source rank, in source order: its rows bound here. Sources hold increasing row
    # ranges, so the received rows arrive in global order: exactly [part_0 | part_1 | …] of r.
    out_splits = [int((dest_of(torch.arange(s * rows // tp, (s + 1) * rows // tp)) == rank)
                      .sum()) for s in range(tp)]
    linear.forward = partial(_fused_colwise_forward, linear, tp_mesh, send_order_R, in_splits,
                             out_splits)


def _fused_colwise_forward(linear: nn.Linear, tp_mesh: DeviceMesh, send_order_R: torch.Tensor,
                           in_splits: list[int], out_splits: list[int],
                           x_TD: torch.Tensor) -> torch.Tensor:
    weight_RD = linear.weight.to_local()
    bias = linear.bias
    # Weight and bias travel in one all-to-all: the bias is one more column.
    send_RC = weight_RD if bias is None else torch.cat([weight_RD, bias.to_local()[:, None]], 1)
    recv_RC = all_to_all_single(send_RC[send_order_R.to(send_RC.device)], out_splits,
                                in_splits, tp_mesh)
    D = weight_RD.shape[1]
    return F.linear(copy_to_group(x_TD, tp_mesh), recv_RC[:, :D],
                    None if bias is None else recv_RC[:, D])
