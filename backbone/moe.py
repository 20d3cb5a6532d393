"""The MoE layer: a top-k router, SwiGLU experts with weights stacked over experts, an optional
shared expert, and a dispatcher that moves tokens to their experts and back.

The dispatcher is an attribute so that expert parallelism (parallel/expert.py) can swap the
default `LocalDispatcher` (permute → grouped GEMM on every expert here → unpermute) for an
all-to-all one without touching this file; expert weights are stacked [E, ...] for the same
reason (EP shards dim 0). Dispatch is dropless: every routed token is computed.

Load balancing, both optional: a Switch-style auxiliary loss and router z-loss (returned in
`aux`, weighted by the caller), and aux-loss-free balancing (DeepSeek-V3): a per-expert bias
added to the scores for selection only, moved after each step by `update_bias`.

Shape suffixes: T tokens, D model width, E experts, K routing choices per token (top-k),
P = T·K routed token copies (sorted by expert), F expert hidden width.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from omniscale.backbone.config import ModelConfig, kernel
from omniscale.backbone.ffn import FeedForward
from omniscale.kernels.reference import expert_counts


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: F.grouped_mm's
    backward rejects expanded (stride-0) gradients such as those of `y.sum()`."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class Experts(nn.Module):
    """E SwiGLU experts, per-expert weights in nn.Linear layout ([out, in]) stacked on dim 0.

    `forward(x_PD, counts_E)`: rows of `x_PD` are grouped by expert, `counts_E[e]` rows for
    expert e (possibly 0). Two equal paths: `F.grouped_mm` (one kernel, no host sync) and
    a loop over experts (fp32 on CPU, where the grouped kernel is ~7× slower; any dtype)."""

    def __init__(self, num_experts: int, d_model: int, ffn_dim: int, grouped_mm: str = "auto",
                 swiglu_kernel: str | None = None):
        super().__init__()
        self.num_experts, self.ffn_dim, self.grouped_mm = num_experts, ffn_dim, grouped_mm
        self.swiglu_kernel = swiglu_kernel  # prefer= for swiglu (None: the registry's choice)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim, d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, ffn_dim))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)

    def use_grouped(self, x_PD: torch.Tensor) -> bool:
        if self.grouped_mm != "auto":
            return self.grouped_mm == "grouped"
        return x_PD.dtype == torch.bfloat16

    def forward(self, x_PD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if self.use_grouped(x_PD):
            return self._grouped(x_PD, counts_E)
        return self._loop(x_PD, counts_E)

    def _grouped(self, x_PD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        h_P2F = F.grouped_mm(x_PD, self.gate_up_proj.transpose(-2, -1), offs=offsets_E)
        gate_PF, up_PF = _ContiguousGrad.apply(h_P2F).chunk(2, dim=-1)
        a_PF = kernel("swiglu", x_PD.device, self.swiglu_kernel)(gate_PF, up_PF)
        y_PD = F.grouped_mm(a_PF, self.down_proj.transpose(-2, -1), offs=offsets_E)
        return _ContiguousGrad.apply(y_PD)

    def _loop(self, x_PD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        swiglu = kernel("swiglu", x_PD.device, self.swiglu_kernel)
        # unbind once: its backward stacks E gradients into one tensor, where indexing
        # weight[e] per expert would build E full-size zero gradients.
        gate_ups, downs = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        outs = []
        for e, x_nD in enumerate(x_PD.split(counts_E.tolist())):
            if x_nD.shape[0] == 0:
                continue  # an empty expert computes nothing (its weights get zero gradient)
            gate_nF, up_nF = F.linear(x_nD, gate_ups[e]).chunk(2, dim=-1)
            outs.append(F.linear(swiglu(gate_nF, up_nF), downs[e]))
        if not outs:
            return x_PD.new_zeros(x_PD.shape)
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class Dispatcher(Protocol):
    """Routes each token's k copies to their experts and combines the results:
    `(x_TD, expert_TK, weight_TK, experts) -> y_TD = Σ_k weight_TK · expert(x_TD)`."""

    def __call__(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, weight_TK: torch.Tensor,
                 experts: Experts) -> torch.Tensor: ...


class LocalDispatcher:
    """Every expert is on this rank: sort the token copies by expert, run the experts, undo.
    `permute_kernel` / `unpermute_kernel`: prefer= for moe_permute / moe_unpermute."""

    def __init__(self, permute_kernel: str | None = None, unpermute_kernel: str | None = None):
        self.permute_kernel, self.unpermute_kernel = permute_kernel, unpermute_kernel

    def __call__(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, weight_TK: torch.Tensor,
                 experts: Experts) -> torch.Tensor:
        permute = kernel("moe_permute", x_TD.device, self.permute_kernel)
        unpermute = kernel("moe_unpermute", x_TD.device, self.unpermute_kernel)
        x_PD, order_P, counts_E = permute(x_TD, expert_TK, experts.num_experts)
        y_PD = experts(x_PD, counts_E)
        return unpermute(y_PD, order_P, weight_TK)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        m = config.moe
        self.num_experts, self.top_k = m.num_experts, m.top_k
        self.router_kind, self.norm_topk_prob = m.router, m.norm_topk_prob
        self.bias_update_rate = m.bias_update_rate
        self.router = nn.Linear(config.d_model, m.num_experts, bias=False)
        swiglu = config.kernel_backend("swiglu")
        self.experts = Experts(m.num_experts, config.d_model, m.expert_ffn_dim, m.grouped_mm,
                               swiglu_kernel=swiglu)
        self.shared_expert = FeedForward(config.d_model, m.shared_dim, swiglu) \
            if m.shared_expert else None
        # Selection-only bias of aux-loss-free balancing: state (checkpointed), not a parameter.
        self.register_buffer("expert_bias_E", torch.zeros(m.num_experts))
        self.dispatcher: Dispatcher = LocalDispatcher(config.kernel_backend("moe_permute"),
                                                      config.kernel_backend("moe_unpermute"))

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(expert_TK, weight_TK, aux): each token's k experts and combine weights, and the
        router statistics: `aux_loss` (Switch: E·Σ_e f_e·p_e, 1 when balanced), `z_loss`
        (mean squared logsumexp of the logits) and `load_E` (routed copies per expert)."""
        logits_TE = self.router(x_TD).float()
        if self.router_kind == "softmax":
            scores_TE = logits_TE.softmax(-1)
        else:
            scores_TE = logits_TE.sigmoid()
        select_TE = scores_TE + self.expert_bias_E if self.bias_update_rate > 0 else scores_TE
        expert_TK = select_TE.topk(self.top_k, dim=-1).indices
        weight_TK = scores_TE.gather(-1, expert_TK)
        if self.router_kind == "sigmoid" or self.norm_topk_prob:
            weight_TK = weight_TK / weight_TK.sum(-1, keepdim=True).clamp_min(1e-20)

        load_E = expert_counts(expert_TK, self.num_experts)
        T = x_TD.shape[0]
        frac_E = load_E.float() / max(T * self.top_k, 1)
        probs_TE = scores_TE if self.router_kind == "softmax" else \
            scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)
        # Means over tokens; an empty micro-batch (a padded slot) contributes 0, not NaN,
        # while keeping the router in the graph.
        aux_loss = self.num_experts * (frac_E * probs_TE.sum(0) / max(T, 1)).sum()
        z_loss = torch.logsumexp(logits_TE, -1).square().sum() / max(T, 1)
        return expert_TK, weight_TK.to(x_TD.dtype), {"aux_loss": aux_loss, "z_loss": z_loss,
                                                      "load_E": load_E}

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, dict]:
        expert_TK, weight_TK, aux = self.route(x_TD)
        y_TD = self.dispatcher(x_TD, expert_TK, weight_TK, self.experts)
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        return y_TD, aux

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """Aux-loss-free balancing step (DeepSeek-V3), called by the trainer after the
        optimizer step with the step's load (summed over micro-batches, and over data-parallel
        ranks by the caller): bias += rate · sign(mean load − load), so underloaded experts
        become likelier to be selected. A no-op when `bias_update_rate` is 0."""
        if self.bias_update_rate <= 0:
            return
        load_E = load_E.to(self.expert_bias_E.device, torch.float32)
        self.expert_bias_E += self.bias_update_rate * torch.sign(load_E.mean() - load_E)
