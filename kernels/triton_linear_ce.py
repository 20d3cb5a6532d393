"""Fused linear + cross-entropy with a Triton per-chunk step, the signature of
kernels.reference.linear_cross_entropy. The chunk loop (matmuls, gradient accumulation in the
forward) is kernels.fused; this module supplies the step: one program per token row streams
its logits twice — an online max / sum-exp pass for logsumexp, then a pass that overwrites the
logits with the gradient softmax − onehot(label), scaled — so a chunk needs no [C, V] buffer
beyond its logits.

Shapes: C tokens in a chunk, V vocabulary.
"""

from __future__ import annotations

import torch
import triton.language as tl

from omniscale.kernels import reference
from omniscale.kernels.dtensor import dtensor_safe
from omniscale.kernels.fused import linear_cross_entropy_chunked
from omniscale.kernels.triton_launch import block, jit, warps
from omniscale.layout import IGNORE_INDEX

BLOCK_V = 4096


@jit
def _ce_rows(logits_ptr, labels_ptr, loss_ptr, scale, ignore_index,
             V: tl.constexpr, BLOCK_V: tl.constexpr):
    # V is a compile-time constant: fixed per model, and runtime loop bounds trip the
    # interpreter (numpy 2 refuses int() of its 1-element scalars).
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * V
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    # running row max: a scalar, as every block holds at least one real logit
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)  # per-lane Σ exp(x − m)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    lse = m + tl.log(tl.sum(s, axis=0))
    valid = label != ignore_index
    safe = tl.where(valid, label, 0)
    target = tl.load(base + safe)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    g_scale = tl.where(valid, scale, 0.0)
    for start in range(0, V, BLOCK_V):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < V, other=0.0)
        grad = (tl.exp(x - lse) - tl.where(idx == safe, 1.0, 0.0)) * g_scale
        tl.store(base + idx, grad, mask=idx < V)


def triton_chunk_step(logits_CV: torch.Tensor, labels_C: torch.Tensor, scale: float,
                      ignore_index: int) -> torch.Tensor:
    """kernels.fused.ChunkStep in Triton: per-token loss [C]; logits become their gradient."""
    C, V = logits_CV.shape
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C:
        _ce_rows[(C,)](logits_CV, labels_C.contiguous(), loss_C, scale, ignore_index, V=V,
                       BLOCK_V=block(V, BLOCK_V), num_warps=warps(block(V, BLOCK_V)))
    return loss_C


# DTensors (a vocabulary-split head goes through parallel/tensor.py's own loss): op by op
@dtensor_safe(fallback=reference.linear_cross_entropy)
def linear_cross_entropy(hidden_TD: torch.Tensor, weight_VD: torch.Tensor,
                         labels_T: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                         reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` without materialising the [T, V] logits."""
    return linear_cross_entropy_chunked(hidden_TD, weight_VD, labels_T, ignore_index,
                                        reduction, triton_chunk_step)
