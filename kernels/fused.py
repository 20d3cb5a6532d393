"""Fused linear + cross-entropy computed in chunks of tokens, so the [T, V] logits never exist
(Liger-style): each chunk's logits come from one matmul, its loss and the gradient of the loss
w.r.t. those logits from a per-chunk step (a Triton kernel on GPU, in place; pure torch here),
and the gradients w.r.t. hidden and weight are accumulated chunk by chunk already in the
forward pass. The backward only scales them by the incoming gradient.

Peak extra memory: one chunk of logits (fp32) plus dW (fp32) and dH, instead of logits,
their log-softmax and their gradient at full [T, V] size (3 × 5 GB at T=8192, V=151,936 in
fp32). The matmuls run in the compute dtype (bf16 under mixed precision) with fp32
accumulation: see _ChunkedLinearCE.

``chunked_linear_cross_entropy`` (this module) is the CPU implementation of the algorithm (the
registry's CPU default: with cache-sized chunks it is also faster than the reference, whose
[T, V] passes run from memory) and what tools/bench/linear_ce_memory.py measures on CPU;
kernels.triton_linear_ce runs the same loop with the Triton per-chunk step.

Shapes: T tokens, D width, V vocabulary, C tokens in a chunk.
"""

from __future__ import annotations

from typing import Callable

import torch

from omniscale.kernels import reference

# Logits of a chunk stay near this many elements (256 MiB in fp32), whatever V is.
CHUNK_ELEMENTS = 1 << 26
# On CPU, chunks of a fixed number of tokens: small enough that a chunk's logits stay in cache
# while the step's passes run over them, large enough that each chunk's dW update (a read and
# write of all of [V, D]) is amortised. Measured fwd+bwd at T = 2048, one thread: 512 rows
# beat 128, 256, 1024 and 2048 at both V = 8192, D = 256 (the `small` preset: ~0.7× the
# reference's time, ~0.8× that of one 2048-row chunk) and V = 1024, D = 128 (`tiny`).
CPU_CHUNK_ROWS = 512

# (logits_CV fp32, labels_C, scale, ignore_index) -> per-token loss [C] (0 where ignored);
# overwrites logits_CV with d(scale · Σ loss)/d logits.
ChunkStep = Callable[[torch.Tensor, torch.Tensor, float, int], torch.Tensor]


def torch_chunk_step(logits_CV: torch.Tensor, labels_C: torch.Tensor, scale: float,
                     ignore_index: int) -> torch.Tensor:
    """Per-token CE of one chunk; logits become their gradient, in place (no [C, V] copies):
    the softmax is written over the logits by one fused row kernel, and the loss comes from
    the row maximum m, whose softmax is exp(m − lse), so lse = m − log softmax(m) (never an
    underflow: softmax(m) ≥ 1/V)."""
    valid_C = labels_C != ignore_index
    safe_C = torch.where(valid_C, labels_C, 0)
    target_C = logits_CV.gather(1, safe_C[:, None])[:, 0]
    max_C, argmax_C = logits_CV.max(dim=-1)
    grad = torch.softmax(logits_CV, dim=-1, out=logits_CV)
    lse_C = max_C - grad.gather(1, argmax_C[:, None])[:, 0].log()
    loss_C = torch.where(valid_C, lse_C - target_C, 0.0)
    grad[torch.arange(len(labels_C), device=grad.device), safe_C] -= 1.0
    grad.mul_((valid_C.to(grad.dtype) * scale)[:, None])
    return loss_C


def mm_wide(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
            scratch: torch.Tensor | None = None) -> torch.Tensor:
    """out = a @ b, with `out` in the accumulation dtype (fp32) and a, b in the compute dtype
    (bf16 under mixed precision): the matmul runs in the compute dtype, accumulating in fp32.
    CUDA: one GEMM writes fp32 directly (`out_dtype`, cuBLAS bf16 × bf16 → fp32). Elsewhere
    torch has no such kernel: the compute-dtype product (into `scratch`, if given) is rounded
    once."""
    if a.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if out.device.type == "cuda":
        return torch.mm(a, b, out_dtype=out.dtype, out=out)
    return out.copy_(torch.mm(a, b, out=scratch))


def addmm_wide_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scratch: torch.Tensor | None = None) -> torch.Tensor:
    """acc += a @ b, acc in fp32, a and b in the compute dtype (see mm_wide). CUDA: the
    fp32 accumulator is the GEMM's C (beta = 1), so the sum over chunks never leaves fp32 and
    costs no pass of its own; elsewhere each chunk's product is rounded to the compute dtype
    once, then added in fp32 (the error does not grow with the number of chunks)."""
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if acc.device.type == "cuda":
        return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    return acc.add_(torch.mm(a, b, out=scratch))


class _ChunkedLinearCE(torch.autograd.Function):
    """Precision: the three matmuls (logits, dH, dW) run in the compute dtype — bf16 under
    mixed precision, where the fp32 path ran at a tenth of the speed (fp32 GEMMs with TF32
    off: about a sixth of a `1b` step) — with fp32 accumulation where it matters: the logits
    land in fp32 (the softmax / logsumexp step needs them there, and rounding them to bf16
    first would move the loss by up to |z|·2⁻⁹ per logit), and dW, a sum over every chunk, is
    accumulated in fp32 and cast once at the end (a bf16 accumulator would drop the low bits
    of each chunk's addend once the sum has grown). dH needs no accumulator: one GEMM per
    chunk, over V, fp32-accumulated inside it. The gradient of the logits is rounded to the
    compute dtype for its two matmuls, as autograd through a bf16 lm_head would."""

    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, labels_T, ignore_index, reduction, step, chunk):
        ctx.dtypes = hidden_TD.dtype, weight_VD.dtype
        dtype = torch.promote_types(hidden_TD.dtype, weight_VD.dtype)  # as a matmul would need
        hidden_TD, weight_VD = hidden_TD.to(dtype), weight_VD.to(dtype)
        T, V = hidden_TD.shape[0], weight_VD.shape[0]
        # "mean" over no valid token is nan, as F.cross_entropy. Counting them reads a value
        # back from the device: only "mean" needs it (the trainer sums).
        n_valid = int((labels_T != ignore_index).sum()) if reduction != "sum" else None
        scale = 1.0 if reduction == "sum" else (1.0 / n_valid if n_valid else float("nan"))
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        acc = torch.promote_types(dtype, torch.float32)  # the step's dtype: fp32 or fp64
        device = hidden_TD.device
        loss = torch.zeros((), dtype=acc, device=device)
        d_hidden = torch.empty_like(hidden_TD) if ctx.needs_input_grad[0] else None
        d_weight = (torch.zeros(V, hidden_TD.shape[1], dtype=acc, device=weight_VD.device)
                    if ctx.needs_input_grad[1] else None)
        # One logits buffer for every chunk (and, where a narrow product must go through the
        # compute dtype, one scratch per product): a fresh [C, V] block per chunk costs page
        # faults on CPU (the allocator does not cache) and allocator traffic elsewhere.
        rows = min(chunk, T)
        buffer_CV = hidden_TD.new_empty(rows, V, dtype=acc)
        narrow = dtype != acc and device.type != "cuda"
        scratch_CV = hidden_TD.new_empty(rows, V) if narrow else None
        scratch_VD = (weight_VD.new_empty(weight_VD.shape)
                      if narrow and d_weight is not None else None)
        for start in range(0, T, chunk):
            h_CD = hidden_TD[start:start + chunk]
            n = h_CD.shape[0]
            logits_CV = mm_wide(h_CD, weight_VD.T, buffer_CV[:n],
                                None if scratch_CV is None else scratch_CV[:n])
            loss_C = step(logits_CV, labels_T[start:start + chunk], scale, ignore_index)
            loss += loss_C.sum()
            if not want_grad:
                continue
            grad_CV = logits_CV.to(dtype)  # no copy in fp32/fp64
            if d_hidden is not None:
                torch.mm(grad_CV, weight_VD, out=d_hidden[start:start + chunk])
            if d_weight is not None:
                addmm_wide_(d_weight, grad_CV.T, h_CD, scratch_VD)
            del logits_CV, grad_CV
        ctx.save_for_backward(d_hidden, d_weight)
        return loss * scale

    @staticmethod
    def backward(ctx, grad_loss):
        d_hidden, d_weight = ctx.saved_tensors
        dh = None if d_hidden is None else (d_hidden * grad_loss.to(d_hidden.dtype)
                                            ).to(ctx.dtypes[0])
        dw = None if d_weight is None else (d_weight * grad_loss).to(ctx.dtypes[1])
        return dh, dw, None, None, None, None, None


def default_chunk(device: torch.device, vocab: int) -> int:
    """Tokens per chunk: CPU_CHUNK_ROWS on CPU, memory-bounded (CHUNK_ELEMENTS) elsewhere."""
    if torch.device(device).type == "cpu":
        return CPU_CHUNK_ROWS
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def linear_cross_entropy_chunked(hidden_TD: torch.Tensor, weight_VD: torch.Tensor,
                                 labels_T: torch.Tensor, ignore_index: int, reduction: str,
                                 step: ChunkStep, chunk: int | None = None) -> torch.Tensor:
    """The chunked algorithm with a given per-chunk step. ``reduction="none"`` cannot fold the
    per-token upstream gradients into dW ahead of time, so it takes the reference path."""
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"linear_cross_entropy: reduction {reduction!r} not in sum/mean/none")
    if reduction == "none":
        return reference.linear_cross_entropy(hidden_TD, weight_VD, labels_T, ignore_index,
                                              reduction)
    chunk = chunk or default_chunk(hidden_TD.device, weight_VD.shape[0])
    return _ChunkedLinearCE.apply(hidden_TD, weight_VD, labels_T, ignore_index, reduction,
                                  step, chunk)


def chunked_linear_cross_entropy(hidden_TD: torch.Tensor, weight_VD: torch.Tensor,
                                 labels_T: torch.Tensor,
                                 ignore_index: int = reference.IGNORE_INDEX,
                                 reduction: str = "sum") -> torch.Tensor:
    """Linear + cross-entropy without materialising [T, V] logits, pure torch (any device);
    the signature of kernels.reference.linear_cross_entropy."""
    return linear_cross_entropy_chunked(hidden_TD, weight_VD, labels_T, ignore_index,
                                        reduction, torch_chunk_step)
