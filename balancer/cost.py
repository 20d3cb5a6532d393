"""The cost model: predicted compute of an LLM sequence or an encoder item from its size.

`c = α·L + β·L² + γ` per sequence. Packed samples attend only within themselves (block-diagonal
masks), so a micro-batch costs the sum of its samples' costs, never (ΣL)². Encoder items have
the same shape on their own size (patches, mel frames). Units are arbitrary but shared: FLOPs
when built from model dimensions, seconds when fitted to measured step times.

Shape suffixes: T measurements, K fitted parameters (3).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from omniscale.media import MEDIA_KINDS


@dataclass(frozen=True)
class CostModel:
    """`alpha·L + beta·L² + gamma` for a size L (tokens, patches, frames)."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def __call__(self, size) -> np.ndarray:
        size = np.asarray(size, dtype=np.float64)
        return self.alpha * size + self.beta * size * size + self.gamma

    @classmethod
    def from_dims(cls, active_params: int, n_layers: int, d_attn: int,
                  causal: bool = True) -> "CostModel":
        """FLOPs of forward + backward for one sequence of length L.

        Linear part: a matmul with P active parameters costs 2·P FLOPs per token forward and
        twice that backward, so α = 6·P. Attention part, per layer and forward: QKᵀ and A·V
        each cost 2·L²·d_attn FLOPs for full (bidirectional) attention, 4·L²·d_attn in all;
        a causal mask halves it (flash attention skips the masked blocks). Backward is twice
        the forward, so β = 3·2·n_layers·d_attn = 6·n_layers·d_attn (causal) or
        12·n_layers·d_attn (bidirectional, the encoders). Per-sequence overhead γ = 0: only
        a fit from measurements can see it.
        """
        return cls(alpha=6.0 * active_params,
                   beta=(6.0 if causal else 12.0) * n_layers * d_attn,
                   gamma=0.0)


_ZERO = CostModel(0.0, 0.0, 0.0)

# Forward's share of forward + backward: backward computes the gradient of each matmul's input
# and of its weight, two matmuls of the forward's size, so forward is 1/3 of the whole (as
# `CostModel.from_dims`'s 2·P of 6·P; attention alike). A frozen tower runs forward only.
FORWARD_SHARE = 1 / 3


# Encoders relative to the LLM (Costs.from_llm): a ViT with about 1/8 of the active parameters
# and about half the attention width x depth; video attends within a window of about 1,024
# patches (a frame pair), so its quadratic term becomes a per-patch one.
ENCODER_ALPHA_SHARE = 1 / 8
ENCODER_BETA_SHARE = 1 / 2
VIDEO_WINDOW_PATCHES = 1024


@dataclass(frozen=True)
class CommModel:
    """What the two collectives cost: bytes from a model config, over a bandwidth, in cost units.

    Ulysses SP (a sample of L tokens split over k ranks): per layer, the forward re-lays out
    q, k, v and the attention output with an all-to-all each; every rank holds a slice of
    s = ⌈L/k⌉ tokens × `hidden` values and sends (k−1)/k of it, so one rank sends
    4·s·hidden·dtype_bytes·(k−1)/k bytes per layer forward, and as much again backward
    (the transposed all-to-alls): `sp_bytes_per_token` × s × (k−1)/k over all layers. q, k and
    v are counted at full width (grouped-query k, v are narrower, so this over-charges SP).

    Reshard (encoder output on another rank than its consumer): each LLM token of an item is
    one embedding row of `hidden` values, sent forward and its gradient sent back.

    Bytes become time at `bandwidth` bytes/s per rank (what one rank sends, and receives, in
    an all-to-all; `inf` makes both collectives free) and time becomes cost units at
    `unit_seconds` per unit. Defaults: a 7B-like shape, hidden 4096, 32 layers, bf16 (2 bytes);
    25 GB/s; and the simulations' cost `24576·L + L²` read as FLOPs / (6·32·4096): β = 1 is
    this config's causal attention term, 6·layers·hidden FLOPs (`CostModel.from_dims`), so a
    unit is 786,432 FLOPs, 1.97 ns at 400 TFLOP/s sustained (α = 24576 units then means 3.2B
    active matmul parameters, an MoE's active count at this shape).
    """

    hidden: int = 4096
    layers: int = 32
    dtype_bytes: int = 2
    bandwidth: float = 25e9  # bytes/s per rank
    unit_seconds: float = 6 * 32 * 4096 / 400e12  # seconds one cost unit takes

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "dtype_bytes", "bandwidth", "unit_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")

    @property
    def sp_bytes_per_token(self) -> float:
        """Bytes one rank sends per token of its slice, all layers, forward + backward, as k
        grows (a group of k sends (k−1)/k of it): 2 × 4 tensors × layers × hidden × bytes."""
        return 2.0 * 4 * self.layers * self.hidden * self.dtype_bytes

    @property
    def reshard_bytes_per_token(self) -> float:
        """Bytes per LLM token of a resharded item: its embedding out, its gradient back."""
        return 2.0 * self.hidden * self.dtype_bytes

    def units(self, nbytes) -> np.ndarray | float:
        """Cost units of moving `nbytes` at `bandwidth` (0 when the bandwidth is infinite)."""
        return np.asarray(nbytes, np.float64) / self.bandwidth / self.unit_seconds

    def sp_comm(self, tokens, sp_size) -> np.ndarray:
        """Cost units one rank of an SP group of k pays for a sample of `tokens` (0 if k = 1)."""
        k = np.asarray(sp_size, np.int64)
        s = -(-np.asarray(tokens, np.int64) // k)
        return self.units(self.sp_bytes_per_token * s * (k - 1) / k)

    def collectives(self) -> dict:
        """`sp_comm_per_token` and `reshard_per_token` (cost units) for `Costs`."""
        return {"sp_comm_per_token": float(self.units(self.sp_bytes_per_token)),
                "reshard_per_token": float(self.units(self.reshard_bytes_per_token))}

    def describe(self) -> dict:
        """JSON-ready parameters and the derived per-token costs."""
        return {"hidden": self.hidden, "layers": self.layers, "dtype_bytes": self.dtype_bytes,
                "bandwidth_bytes_per_s": self.bandwidth, "unit_seconds": self.unit_seconds,
                "sp_bytes_per_token": self.sp_bytes_per_token,
                "reshard_bytes_per_token": self.reshard_bytes_per_token,
                **self.collectives()}


@dataclass(frozen=True)
class Costs:
    """Everything the planner prices: the LLM, each encoder kind, and the two collectives.

    `sp_comm_per_token`: cost one rank of an SP group of k pays per token of its slice for the
    Ulysses all-to-alls, times (k−1)/k, the part of its slice a rank sends (0 for a sample
    that is not split). `reshard_per_token`: cost of moving one LLM-token embedding from the
    rank that encoded it to the rank that consumes it. `CommModel.collectives` derives both
    from a model config and a bandwidth. `micro_batch`: the fixed cost of one micro-batch on
    every rank (launches, the per-micro-batch FSDP gathers; `omniscale balance calibrate`
    measures it), which a plan pays once per slot; 0 leaves the slot count to the token budget
    and the balance alone.
    """

    llm: CostModel
    encoders: tuple[CostModel, CostModel, CostModel] = field(
        default_factory=lambda: (_ZERO, _ZERO, _ZERO))  # indexed like types.MEDIA_KINDS
    sp_comm_per_token: float = 0.0
    reshard_per_token: float = 0.0
    micro_batch: float = 0.0

    def __post_init__(self) -> None:
        if len(self.encoders) != len(MEDIA_KINDS):
            raise ValueError(f"encoders: need one CostModel per kind {MEDIA_KINDS}, "
                             f"got {len(self.encoders)}")
        if self.sp_comm_per_token < 0 or self.reshard_per_token < 0 or self.micro_batch < 0:
            raise ValueError("sp_comm_per_token, reshard_per_token, micro_batch: must be >= 0")

    @classmethod
    def from_model_dims(cls, active_params: int, n_layers: int, d_attn: int,
                        encoder=None, sp_comm_per_token: float = 0.0,
                        reshard_per_token: float = 0.0) -> "Costs":
        """FLOP-based defaults (see `CostModel.from_dims` for the derivation).

        `encoder`: None (no encoders), or one entry per kind in MEDIA_KINDS order, each an
        `(active_params, n_layers, d_attn)` triple or None for a kind the model lacks. Encoders
        attend bidirectionally, so their β is twice the causal one.
        """
        encoder = (None,) * len(MEDIA_KINDS) if encoder is None else tuple(encoder)
        if len(encoder) != len(MEDIA_KINDS):
            raise ValueError(f"encoder: need one entry per kind {MEDIA_KINDS}, "
                             f"got {len(encoder)}")
        models = tuple(_ZERO if dims is None else CostModel.from_dims(*dims, causal=False)
                       for dims in encoder)
        return cls(llm=CostModel.from_dims(active_params, n_layers, d_attn, causal=True),
                   encoders=models, sp_comm_per_token=sp_comm_per_token,
                   reshard_per_token=reshard_per_token)

    @classmethod
    def from_llm(cls, alpha: float, beta: float, **collectives) -> "Costs":
        """LLM cost ``alpha·L + beta·L²``, encoders priced relative to it, for when only the
        LLM's coefficients are known (simulations, a plane started without model dims).

        Encoders are smaller than the LLM (``alpha / 8`` per patch) and attend
        bidirectionally within an image or clip (``beta / 2``). Video attention stays inside a
        window of about ``VIDEO_WINDOW_PATCHES`` patches, so its cost is linear in clip size.
        """
        a, b = alpha * ENCODER_ALPHA_SHARE, beta * ENCODER_BETA_SHARE
        return cls(llm=CostModel(alpha, beta),
                   encoders=(CostModel(a, b), CostModel(a + b * VIDEO_WINDOW_PATCHES, 0.0),
                             CostModel(a, b)), **collectives)

    def forward_only(self, kinds) -> "Costs":
        """These costs with the encoders of ``kinds`` (names of MEDIA_KINDS) priced forward
        only: a frozen tower needs no backward (the trainer's ``optim.groups``). Their models,
        FLOP-based or calibrated (both time forward + backward), are scaled by
        ``FORWARD_SHARE``; for measured seconds that is the FLOPs' proportion, an estimate the
        online refit does not correct (it fits the LLM's model)."""
        unknown = set(kinds) - set(MEDIA_KINDS)
        if unknown:
            raise ValueError(f"forward_only: unknown encoder kinds {sorted(unknown)} (known: "
                             f"{', '.join(MEDIA_KINDS)})")
        f = FORWARD_SHARE
        return replace(self, encoders=tuple(
            CostModel(m.alpha * f, m.beta * f, m.gamma * f) if kind in kinds else m
            for kind, m in zip(MEDIA_KINDS, self.encoders)))

    def item_cost(self, item_size_M: np.ndarray, item_kind_M: np.ndarray) -> np.ndarray:
        """Encoder cost of each item, priced by its kind's model."""
        cost_M = np.zeros(len(item_size_M), np.float64)
        for kind, model in enumerate(self.encoders):
            mine = item_kind_M == kind
            if mine.any():
                cost_M[mine] = model(item_size_M[mine])
        return cost_M


@dataclass(frozen=True)
class FitResult:
    model: CostModel
    r2: float  # coefficient of determination on the fitted data
    mape: float  # median absolute percentage error, as a fraction (0.02 = 2 %)


def _design(features_X) -> np.ndarray:
    """Rows [ΣL, ΣL², count]: a measurement's time is the sum of its sequences' costs."""
    per_step = isinstance(features_X, (list, tuple)) and any(np.ndim(f) > 0 for f in features_X)
    if per_step:
        rows = []
        for f in features_X:
            lengths = np.atleast_1d(np.asarray(f, dtype=np.float64))
            rows.append((lengths.sum(), (lengths * lengths).sum(), float(len(lengths))))
        return np.asarray(rows, dtype=np.float64).reshape(-1, 3)
    lengths = np.asarray(features_X, dtype=np.float64)
    if lengths.ndim != 1:
        raise ValueError(f"features_X: expected lengths (1-D) or a list of arrays of lengths, "
                         f"got shape {lengths.shape}")
    return np.stack([lengths, lengths * lengths, np.ones_like(lengths)], axis=1)


def fit(features_X, times_T, nonnegative: bool = False) -> FitResult:
    """Least-squares α, β, γ from measured times.

    `features_X` is either one length per measurement (a single sequence each) or, per
    measurement, an array of the lengths of the sequences it ran (a step or micro-batch whose
    time is the sum of its sequences' costs). Raises ValueError when the measurements cannot
    determine three parameters, rather than return a silently meaningless model.
    `nonnegative`: the best fit with every coefficient ≥ 0 (each subset of the three terms is
    fitted and the best one whose coefficients are all ≥ 0 kept: exact for three terms), so
    noise cannot make a cost that falls with length.
    """
    A_TK = _design(features_X)
    t_T = np.asarray(times_T, dtype=np.float64).reshape(-1)
    if len(A_TK) != len(t_T):
        raise ValueError(f"times_T: {len(t_T)} times for {len(A_TK)} measurements")
    if len(t_T) < A_TK.shape[1]:
        raise ValueError(f"fit: {len(t_T)} measurements cannot determine {A_TK.shape[1]} "
                         "parameters (alpha, beta, gamma); measure at least 3 different sizes")
    # Scale columns so L² (up to ~1e10) and 1 are comparable; lstsq is then well conditioned.
    scale_K = np.abs(A_TK).max(axis=0)
    scale_K[scale_K == 0] = 1.0
    if np.linalg.matrix_rank(A_TK / scale_K) < A_TK.shape[1]:
        raise ValueError("fit: the measurements do not determine alpha, beta and gamma "
                         "(need at least 3 different lengths or length mixes)")
    coef_K, *_ = np.linalg.lstsq(A_TK / scale_K, t_T, rcond=None)
    coef_K = coef_K / scale_K
    if nonnegative and (coef_K < 0).any():
        coef_K = nonnegative_lstsq(A_TK / scale_K, t_T) / scale_K
    pred_T = A_TK @ coef_K
    ss_res = float(((t_T - pred_T) ** 2).sum())
    ss_tot = float(((t_T - t_T.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    nonzero = t_T != 0
    mape = float(np.median(np.abs(pred_T[nonzero] - t_T[nonzero]) / np.abs(t_T[nonzero]))) \
        if nonzero.any() else 0.0
    return FitResult(model=CostModel(*(float(c) for c in coef_K)), r2=r2, mape=mape)


def nonnegative_lstsq(A_TK: np.ndarray, t_T: np.ndarray) -> np.ndarray:
    """The least-squares coefficients ≥ 0 (zero on the terms left out), over every subset of
    the columns (exact; for the few terms of a cost model)."""
    import itertools

    best, best_res = np.zeros(A_TK.shape[1]), float((t_T ** 2).sum())
    for size in range(1, A_TK.shape[1] + 1):
        for cols in itertools.combinations(range(A_TK.shape[1]), size):
            sub, *_ = np.linalg.lstsq(A_TK[:, cols], t_T, rcond=None)
            if (sub < 0).any():
                continue
            coef = np.zeros(A_TK.shape[1])
            coef[list(cols)] = sub
            res = float(((A_TK @ coef - t_T) ** 2).sum())
            if res < best_res:
                best, best_res = coef, res
    return best
