"""The MoE decoder LM over packed sequences: token embeddings, N pre-norm blocks (attention,
then a dense SwiGLU for the first `n_dense_layers` layers and MoE after), a final norm and the
LM head (tied to the embeddings or not). Callers pass embeddings, not token ids, so the omni
model can scatter encoder outputs into placeholder positions first.

Shape suffixes: T tokens (all packed sequences of a micro-batch), D model width, S sequences
(cu_seqlens has S+1 entries), K head dim, L layers (MoE layers only, in aux), E experts,
V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from omniscale.backbone.attention import Attention, rope_tables
from omniscale.backbone.config import ModelConfig, kernel
from omniscale.backbone.ffn import FeedForward
from omniscale.backbone.moe import Experts, MoE
from omniscale.backbone.norm import RMSNorm
from omniscale.kernels.transfer import host_to_device
from omniscale.layout import IGNORE_INDEX


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        norm_kernels = {op: config.kernel_backend(op) for op in ("rms_norm", "add_rms_norm")}
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, norm_kernels)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, norm_kernels)
        self.is_moe = config.is_moe_layer(layer)
        self.ffn = MoE(config) if self.is_moe else \
            FeedForward(config.d_model, config.ffn_dim, config.kernel_backend("swiglu"))

    def forward(self, x_TD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                cu_seqlens_S1: torch.Tensor, max_seqlen: int
                ) -> tuple[torch.Tensor, dict | None]:
        a_TD = self.attn(self.attn_norm(x_TD), cos_TK, sin_TK, cu_seqlens_S1, max_seqlen)
        normed_TD, h_TD = self.ffn_norm.add_forward(a_TD, x_TD)  # h = x + a, then its norm
        if self.is_moe:
            y_TD, aux = self.ffn(normed_TD)
            return h_TD + y_TD, aux
        return h_TD + self.ffn(normed_TD), None


class MoEDecoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps,
                            {"rms_norm": config.kernel_backend("rms_norm")})
        self.lm_head = None if config.tie_embeddings else \
            nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every weight and buffer at its initial value (``reset_module``, module by module)."""
        for module in self.modules():
            self.reset_module(module)

    @torch.no_grad()
    def reset_module(self, module: nn.Module) -> None:
        """The initial value of ``module``'s own parameters and buffers (not its children's),
        for a module of this decoder: Normal(0, init_std) matrices, unit norms, zero expert
        biases. The trainer calls it one tensor at a time on full-size stand-ins, to
        initialise a model built on the meta device shard by shard, alike in every layout
        (``parallel.load.init_parameters``)."""
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, Experts):
            module.reset_parameters(std)
        elif isinstance(module, RMSNorm):
            module.reset_parameters()
        elif isinstance(module, MoE):
            module.expert_bias_E.zero_()

    @property
    def lm_weight_VD(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, inputs_embeds_TD: torch.Tensor, position_ids_T: torch.Tensor,
                cu_seqlens_S1: torch.Tensor, max_seqlen: int,
                mrope_3T: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Final-normed hidden states and the router statistics.

        `position_ids_T` restart at 0 in each sequence; `mrope_3T` (temporal, height, width
        positions; equal for text tokens) switches rotary to M-RoPE. Attention stays within
        each sequence of `cu_seqlens_S1`. `aux`: `aux_loss_L`, `z_loss_L`, `load_LE` per MoE
        layer, and `router_loss` = Σ (aux_loss_coef·aux + z_loss_coef·z), a per-token mean
        to add to the mean cross-entropy (0 for a dense model)."""
        cos_TK, sin_TK = rope_tables(self.config, position_ids_T, mrope_3T)
        cos_TK, sin_TK = cos_TK.to(inputs_embeds_TD.dtype), sin_TK.to(inputs_embeds_TD.dtype)
        x_TD = inputs_embeds_TD
        stats = []
        for layer in self.layers:
            x_TD, aux = layer(x_TD, cos_TK, sin_TK, cu_seqlens_S1, max_seqlen)
            if aux is not None:
                stats.append(aux)
        return self.norm(x_TD), self._collect(stats, x_TD)

    def _collect(self, stats: list[dict], x_TD: torch.Tensor) -> dict:
        if not stats:
            zero = x_TD.new_zeros((), dtype=torch.float32)
            return {"router_loss": zero, "aux_loss_L": zero[None][:0], "z_loss_L": zero[None][:0],
                    "load_LE": torch.zeros(0, 0, dtype=torch.long, device=x_TD.device)}
        m = self.config.moe
        aux_L = torch.stack([s["aux_loss"] for s in stats])
        z_L = torch.stack([s["z_loss"] for s in stats])
        return {"router_loss": m.aux_loss_coef * aux_L.sum() + m.z_loss_coef * z_L.sum(),
                "aux_loss_L": aux_L, "z_loss_L": z_L,
                "load_LE": torch.stack([s["load_E"] for s in stats])}

    def logits(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        return hidden_TD @ self.lm_weight_VD.T

    def loss(self, hidden_TD: torch.Tensor, labels_T: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed cross-entropy, number of counted tokens). Labels are already shifted
        (label t is the token after t); IGNORE_INDEX is ignored. A sum, so micro-batches and ranks
        add up exactly before the one division by the global token count."""
        ce = kernel("linear_cross_entropy", hidden_TD.device,
                    self.config.kernel_backend("linear_cross_entropy"))
        # under bf16 mixed precision the head's weight is bf16 while the final norm may hand
        # back fp32: the head computes in its weight's dtype (the CE accumulates in fp32)
        loss_sum = ce(hidden_TD.to(self.lm_weight_VD.dtype), self.lm_weight_VD, labels_T,
                      ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum, (labels_T != IGNORE_INDEX).sum()

    @torch.no_grad()
    def update_bias(self, load_LE: torch.Tensor) -> None:
        """Aux-loss-free balancing for every MoE layer (`aux["load_LE"]`, summed over the
        step's micro-batches and data-parallel ranks)."""
        moes = [layer.ffn for layer in self.layers if layer.is_moe]
        for moe, load_E in zip(moes, load_LE, strict=True):
            moe.update_bias(load_E)


def grouped_loss(loss_sum, hidden_TD: torch.Tensor, labels_T: torch.Tensor,
                 group_T: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(loss_G, n_G)`: the summed cross-entropy and counted targets of each group's rows
    (e.g. each token's source), scored apart so the split costs no extra logits.
    `loss_sum(hidden_TD, labels_T)` is the summed loss of some rows (`MoEDecoder.loss`'s
    first value, or a pipeline stage's `loss`). Give `group_T` on the CPU: each group's rows
    are then found there and copied over without waiting for the device (finding them on a
    GPU would wait for it, once per group)."""
    losses, counts = [], []
    device = hidden_TD.device
    for g in range(num_groups):
        rows_T = (group_T == g).nonzero().squeeze(1)
        if rows_T.device != device:
            rows_T = host_to_device(rows_T, device)
        if rows_T.numel() == 0:
            losses.append(hidden_TD.new_zeros((), dtype=torch.float32))
            counts.append(torch.zeros((), dtype=torch.int64, device=hidden_TD.device))
            continue
        labels = labels_T.index_select(0, rows_T)
        losses.append(loss_sum(hidden_TD.index_select(0, rows_T), labels).float())
        counts.append((labels != IGNORE_INDEX).sum())
    return torch.stack(losses), torch.stack(counts)
