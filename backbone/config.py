"""Backbone configuration: shapes, presets, and the parameter and FLOP accounting built on them.

The accounting is analytic (no module is built) so that 30B-class shapes can be priced on a
laptop; `tests/backbone/test_config.py` checks it against the real modules' parameters.
FLOPs follow `balancer.cost.CostModel.from_dims`: a matmul with P parameters costs 6·P per token
for forward + backward; causal attention over a sequence of length L costs
6·n_layers·(n_heads·head_dim)·L² for forward + backward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class MoEConfig:
    """Routed experts of one MoE layer.

    `router`: "softmax" (Qwen3: softmax over all experts, then top-k, optionally renormalised)
    or "sigmoid" (DeepSeek-V3: independent sigmoid scores, the k chosen ones renormalised).
    `bias_update_rate` > 0 turns on aux-loss-free balancing: a per-expert bias added to the
    scores for selection only, moved by `MoE.update_bias` after each step.
    `grouped_mm`: "auto" (F.grouped_mm for bf16, where it is fast; a per-expert loop for
    fp32, where the CPU grouped kernel is slower: ~10% per MoE layer fwd+bwd at the `small`
    shapes, torch 2.11), "grouped" or "loop".
    """

    num_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int = 256
    shared_expert: bool = False
    shared_ffn_dim: int | None = None  # None: expert_ffn_dim
    router: str = "softmax"
    norm_topk_prob: bool = True  # softmax router: renormalise the k weights (sigmoid always does)
    aux_loss_coef: float = 1e-3
    z_loss_coef: float = 1e-3
    bias_update_rate: float = 0.0
    grouped_mm: str = "auto"

    def __post_init__(self) -> None:
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"moe.router: must be 'softmax' or 'sigmoid', got {self.router!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe.top_k: must be in [1, num_experts={self.num_experts}], "
                             f"got {self.top_k}")
        if self.grouped_mm not in ("auto", "grouped", "loop"):
            raise ValueError(f"moe.grouped_mm: must be 'auto', 'grouped' or 'loop', "
                             f"got {self.grouped_mm!r}")

    @property
    def shared_dim(self) -> int:
        return self.shared_ffn_dim or self.expert_ffn_dim


# Ops the backbone looks up through the kernel registry (besides attention).
KERNEL_OPS = ("rms_norm", "add_rms_norm", "rotary", "swiglu", "moe_permute", "moe_unpermute",
              "linear_cross_entropy")


def kernel(op: str, device, prefer: str | None = None):
    """`kernels.get(op, device, prefer=prefer)`, except that a named backend the op lacks on
    this device (e.g. "compiled" for moe_permute, or anywhere on CUDA) gives the automatic
    choice rather than the reference, so one config serves CPU and GPU; "reference" is kept."""
    from omniscale import kernels  # here, so that the accounting above imports no torch

    fn = kernels.get(op, device, prefer=prefer)
    if prefer in (None, "auto", "reference") or \
            getattr(fn, "_omniscale_backend", None) == prefer:
        return fn
    return kernels.get(op, device)


@dataclass
class ModelConfig:
    """The MoE decoder. `moe=None` makes every layer dense; otherwise the first
    `n_dense_layers` layers use a dense SwiGLU of width `ffn_dim` and the rest are MoE.
    `vision` / `audio` hold encoder configs (filled by encoders/; None: text only)."""

    vocab_size: int = 32000
    d_model: int = 512
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 64
    ffn_dim: int = 1536
    moe: MoEConfig | None = field(default_factory=MoEConfig)
    n_dense_layers: int = 0
    qk_norm: bool = True
    rope_theta: float = 1e6
    mrope_sections: tuple[int, int, int] | None = None  # None: head_dim/2 split 1/4, 3/8, 3/8
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    attention_backend: str | None = None  # kernels.get(..., prefer=): "flash", "flex", ...
    # Per-op kernel backend, passed as kernels.get(op, device, prefer=...) for every op the
    # model looks up except attention (attention_backend): e.g. {"*": "compiled"} (every op
    # that has one; "*" is the default for ops not named) or {"rms_norm": "compiled"}. A
    # backend that an op lacks on the device falls back to the automatic choice (see kernel()).
    kernels: dict[str, str] | None = None
    init_std: float = 0.02
    vision: object | None = None
    audio: object | None = None

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads}: must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: must be even (rotary pairs)")
        if self.mrope_sections is None:
            half = self.head_dim // 2
            t = half // 4
            h = (half - t) // 2
            self.mrope_sections = (t, h, half - t - h)
        self.mrope_sections = tuple(self.mrope_sections)
        if len(self.mrope_sections) != 3 or sum(self.mrope_sections) != self.head_dim // 2:
            raise ValueError(f"mrope_sections={self.mrope_sections}: need 3 ints summing to "
                             f"head_dim/2 = {self.head_dim // 2}")
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if self.kernels is not None:
            self.kernels = dict(self.kernels)
            unknown = set(self.kernels) - set(KERNEL_OPS) - {"*"}
            if unknown:
                hint = " (attention: use attention_backend)" \
                    if "varlen_attention" in unknown else ""
                raise ValueError(f"kernels: unknown op(s) {sorted(unknown)}{hint}; known: "
                                 f"{', '.join(KERNEL_OPS)} or '*'")

    def kernel_backend(self, op: str) -> str | None:
        """The `prefer=` for op (None: the registry's automatic choice)."""
        if op == "varlen_attention":
            return self.attention_backend
        if not self.kernels:
            return None
        return self.kernels.get(op, self.kernels.get("*"))

    # ---- presets -------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """`tiny` (a CPU training step in well under a second at 2K tokens), `small`
        (CPU benchmarks), `1b` (1B-class MoE), `30b_a3b` (Qwen3-30B-A3B shapes)."""
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
        config = PRESETS[name]()
        return dataclasses.replace(config, **overrides) if overrides else config

    # ---- accounting ----------------------------------------------------------------------

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def _attention_params(self) -> int:
        d_q, d_kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        norms = 2 * self.head_dim if self.qk_norm else 0
        return self.d_model * (d_q + 2 * d_kv) + d_q * self.d_model + norms

    def _layer_params(self, layer: int, active: bool) -> int:
        """Parameters of one block (active: those one token's forward touches)."""
        n = self._attention_params() + 2 * self.d_model  # + the two pre-norms
        if not self.is_moe_layer(layer):
            return n + 3 * self.d_model * self.ffn_dim
        m = self.moe
        experts = m.top_k if active else m.num_experts
        n += self.d_model * m.num_experts  # router (every token scores every expert)
        n += experts * 3 * self.d_model * m.expert_ffn_dim
        if m.shared_expert:
            n += 3 * self.d_model * m.shared_dim
        return n

    def _embedding_params(self) -> tuple[int, int]:
        """(input table, output head); the head is 0 when tied to the table."""
        table = self.vocab_size * self.d_model
        return table, 0 if self.tie_embeddings else table

    def param_count(self) -> int:
        """Every parameter of `MoEDecoder(self)` (buffers such as expert biases excluded)."""
        table, head = self._embedding_params()
        layers = sum(self._layer_params(i, active=False) for i in range(self.n_layers))
        return table + head + layers + self.d_model  # + final norm

    def active_param_count(self, embeddings: bool = True) -> int:
        """Parameters one token uses: top-k experts only. `embeddings=True` counts the input
        table and the head (the "3B active" convention); False gives the matmul parameters
        that set the FLOPs (the head is a matmul, the table lookup is not)."""
        table, head = self._embedding_params()
        layers = sum(self._layer_params(i, active=True) for i in range(self.n_layers))
        norms = self.d_model
        if embeddings:
            return table + head + layers + norms
        return self.vocab_size * self.d_model + layers  # lm head (tied or not) is a matmul

    def cost_dims(self) -> tuple[int, int, int]:
        """`(active_params, n_layers, d_attn)` for `balancer.cost.Costs.from_model_dims`."""
        return (self.active_param_count(embeddings=False), self.n_layers,
                self.n_heads * self.head_dim)

    def cost_coefficients(self) -> tuple[float, float]:
        """(α, β) of `c = α·L + β·L²` FLOPs per sequence, forward + backward, causal:
        α = 6·active matmul params, β = 6·n_layers·n_heads·head_dim (CostModel.from_dims)."""
        active, n_layers, d_attn = self.cost_dims()
        return 6.0 * active, 6.0 * n_layers * d_attn

    def flops_per_token(self, seq_len: int) -> dict[str, float]:
        """Training FLOPs per token for sequences of length `seq_len` (for MFU):
        `linear` (= α) and `attention` (= β·L, the causal average), and their `total`."""
        alpha, beta = self.cost_coefficients()
        return {"linear": alpha, "attention": beta * seq_len,
                "total": alpha + beta * seq_len}


def _tiny() -> ModelConfig:
    return ModelConfig(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=32, ffn_dim=384,
                       moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=128))


def _small() -> ModelConfig:
    return ModelConfig(vocab_size=8192, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2,
                       head_dim=32, ffn_dim=768,
                       moe=MoEConfig(num_experts=16, top_k=4, expert_ffn_dim=256))


def _1b() -> ModelConfig:
    # ~1.2B total, ~0.35B active with embeddings (OLMoE-like proportions, Qwen3 vocabulary).
    return ModelConfig(vocab_size=151936, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=4,
                       head_dim=64, ffn_dim=3072,
                       moe=MoEConfig(num_experts=32, top_k=4, expert_ffn_dim=512))


def _30b_a3b() -> ModelConfig:
    # Qwen3-30B-A3B: 48 layers, 32 q / 4 kv heads of 128, 128 experts of 768, top-8.
    return ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                       head_dim=128, ffn_dim=6144, rope_theta=1e6, mrope_sections=(16, 24, 24),
                       moe=MoEConfig(num_experts=128, top_k=8, expert_ffn_dim=768))


PRESETS = {"tiny": _tiny, "small": _small, "1b": _1b, "30b_a3b": _30b_a3b}
