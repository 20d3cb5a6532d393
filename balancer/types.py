"""What the balancer takes in and gives out: flat numpy arrays, no objects per sample.

Shape-suffix legend: N samples in a window, M encoder items (images, clips, audio clips) of
those samples, P placements (one per sample per rank it runs on), R ranks (data-parallel size),
B micro-batch slots, S steps in the window.

A window is W consecutive global batches as the mixer drew them; the planner may move a sample
to any step of its window (so displacement is at most W-1) and to any rank. A sample whose cost
is too big for one rank runs on a sequence-parallel (SP) group of k ranks (k a power of two);
SP groups are aligned, ranks ``[g*k, (g+1)*k)``, so the trainer can create them once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


def slice_tokens(tokens: np.ndarray | int, sp_size: np.ndarray | int) -> np.ndarray | int:
    """Tokens one rank of an SP group holds: the sequence padded to a multiple of k, split."""
    return -(-np.asarray(tokens) // np.asarray(sp_size))


@dataclass(frozen=True)
class WindowSamples:
    """The samples of one window, as the mixer drew them."""

    tokens_N: np.ndarray  # int64: LLM tokens after media expansion
    source_N: np.ndarray  # int32: source id (index into the mixture's sources)
    batch_N: np.ndarray  # int32: the global batch (0..W-1) the mixer drew the sample for
    item_offsets_N1: np.ndarray  # int64 [N+1]: sample i owns items [off[i], off[i+1])
    item_size_M: np.ndarray  # int64: encoder input size (patches; mel frames for audio)
    item_kind_M: np.ndarray  # int8: index into MEDIA_KINDS
    item_tokens_M: np.ndarray  # int64: LLM tokens the item becomes (embeddings to reshard)

    @property
    def num_samples(self) -> int:
        return len(self.tokens_N)

    @property
    def num_items(self) -> int:
        return len(self.item_size_M)

    @classmethod
    def from_lengths(cls, tokens_N, source_N=None, batch_N=None) -> "WindowSamples":
        """Text-only samples (no encoder items); one source and one batch unless given."""
        tokens_N = np.asarray(tokens_N, dtype=np.int64)
        n = len(tokens_N)
        return cls(
            tokens_N=tokens_N,
            source_N=np.zeros(n, np.int32) if source_N is None else np.asarray(source_N, np.int32),
            batch_N=np.zeros(n, np.int32) if batch_N is None else np.asarray(batch_N, np.int32),
            item_offsets_N1=np.zeros(n + 1, np.int64),
            item_size_M=np.zeros(0, np.int64),
            item_kind_M=np.zeros(0, np.int8),
            item_tokens_M=np.zeros(0, np.int64),
        )

    def validate(self) -> None:
        """Raise ValueError naming the first array that is inconsistent."""
        n, m = self.num_samples, self.num_items
        for name in ("source_N", "batch_N"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name}: length {len(getattr(self, name))}, expected {n}")
        offsets = self.item_offsets_N1
        if len(offsets) != n + 1 or (n + 1 and offsets[0] != 0) or (n and offsets[-1] != m) \
                or np.any(np.diff(offsets) < 0):
            raise ValueError("item_offsets_N1: must rise from 0 to the number of items")
        for name in ("item_kind_M", "item_tokens_M"):
            if len(getattr(self, name)) != m:
                raise ValueError(f"{name}: length {len(getattr(self, name))}, expected {m}")
        if n and self.tokens_N.min() <= 0:
            raise ValueError(f"tokens_N: sample {int(np.argmin(self.tokens_N))} has no tokens")
        if n and self.batch_N.min() < 0:
            raise ValueError("batch_N: must be >= 0")


def split_heads(plan) -> dict[int, list[int]]:
    """Each sample a plan split with heads sized by speed: its ranks' query heads in slice
    order. Empty when every split has H/k heads each (``sp_heads_P`` None or 0)."""
    if plan.sp_heads_P is None:
        return {}
    heads_P = np.asarray(plan.sp_heads_P)
    return _by_split_sample(plan, heads_P, heads_P > 0)


def split_lengths(plan) -> dict[int, list[int]]:
    """Each sample a plan (a ``StepPlan``, or anything with its placement arrays) split with
    slices sized by speed: its slices' tokens in slice order. Empty when the slices are
    equal (``sp_tokens_P`` None)."""
    if plan.sp_tokens_P is None:
        return {}
    return _by_split_sample(plan, np.asarray(plan.sp_tokens_P), True)


def _by_split_sample(plan, values_P: np.ndarray, keep_P) -> dict[int, list[int]]:
    """``values_P`` of each split sample's placements (where ``keep_P``), in slice order."""
    split = (np.asarray(plan.sp_size_P) > 1) & keep_P
    by_sample: dict[int, dict[int, int]] = {}
    for sample, index, value in zip(np.asarray(plan.sample_P)[split].tolist(),
                                    np.asarray(plan.sp_index_P)[split].tolist(),
                                    values_P[split].tolist()):
        by_sample.setdefault(sample, {})[index] = value
    return {s: [v for _, v in sorted(by_index.items())] for s, by_index in by_sample.items()}


SYNCS = ("micro_batch", "step")  # PlannerConfig.sync


@dataclass(frozen=True)
class PlannerConfig:
    dp: int  # ranks
    micro_batch_tokens: int  # hard per-rank per-micro-batch token budget
    window: int = 4  # W global batches planned together
    sp_max: int = 8  # largest SP group (power of two); 1 disables the long-short split
    epsilon: float = 0.05  # per-step token and source-proportion tolerance
    # each rank's measured relative speed (cost per second, any scale), None: equal ranks. A
    # rank at half the others' speed takes twice as long for the same cost, and the planner
    # gives it about half the work; the baselines ignore it (they plan per step by tokens or
    # cost alone) but their plans are reported with it.
    rank_speed: tuple[float, ...] | None = None
    # When ranks wait for each other: "micro_batch" (FSDP's per-micro-batch gathers, the SP
    # and EP all-to-alls: a step is Σ over slots of the slowest rank) or "step" (data
    # parallelism that all-reduces once a step: the slowest rank's sum). What the planner
    # minimises; the trainer's layouts shard parameters, so "micro_batch" by default.
    sync: str = "micro_batch"
    # The model's query heads: with speeds, a split sample's ranks may attend heads in
    # proportion to their speeds (``balancer.speed_split``, ``parallel.sequence``). 0: not
    # known to the planner -- H/k heads each, as without speeds.
    n_heads: int = 0

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ValueError(f"dp: must be >= 1, got {self.dp}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens: must be >= 1, got {self.micro_batch_tokens}")
        if self.window < 1:
            raise ValueError(f"window: must be >= 1, got {self.window}")
        if self.sp_max < 1 or self.sp_max & (self.sp_max - 1):
            raise ValueError(f"sp_max: must be a power of two >= 1, got {self.sp_max}")
        if not 0 <= self.epsilon < 1:
            raise ValueError(f"epsilon: must be in [0, 1), got {self.epsilon}")
        if self.n_heads < 0:
            raise ValueError(f"n_heads: must be >= 0 (0: not known), got {self.n_heads}")
        if self.sync not in SYNCS:
            raise ValueError(f"sync: must be one of {', '.join(SYNCS)}, got {self.sync!r}")
        if self.rank_speed is not None and (
                len(self.rank_speed) != self.dp
                or not all(math.isfinite(v) and v > 0 for v in self.rank_speed)):
            raise ValueError(f"rank_speed: one finite speed > 0 per rank ({self.dp}), got "
                             f"{list(self.rank_speed)}")

    @property
    def speed_R(self) -> np.ndarray | None:
        return None if self.rank_speed is None else np.asarray(self.rank_speed, np.float64)


@dataclass
class StepPlan:
    """One step of a window: every placement, the micro-batch grid, the encoder plan."""

    step: int  # index within the window, 0..W-1
    # LLM placements: a whole sample has one row; a sample split over an SP group of k ranks
    # has k rows (same micro-batch slot on each), sp_index 0..k-1 saying which slice.
    sample_P: np.ndarray  # int64: window-local sample index
    rank_P: np.ndarray  # int32
    micro_batch_P: np.ndarray  # int32: slot, 0..num_micro_batches-1
    sp_size_P: np.ndarray  # int32: k (1 = whole)
    sp_index_P: np.ndarray  # int32
    num_micro_batches: int  # the same on every rank; a rank's unused slots are empty
    mb_cost_RB: np.ndarray  # float64 [R, B]: predicted cost of each rank's micro-batch
    mb_tokens_RB: np.ndarray  # int64 [R, B]: tokens (slices for SP) in each micro-batch
    # no assignment of this step's samples can have a smaller max rank time (cost / speed with
    # speed_R; the cost when ranks are equal)
    lower_bound: float
    # Encoder plan, independent of the LLM placement: one row per encoder item of the step.
    item_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # window item id
    item_sample_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    encode_rank_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    consume_rank_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    encoder_cost_R: np.ndarray | None = None  # float64 [R]: predicted encoder cost per rank
    reshard: bool = False  # False: the plan decided moving embeddings does not pay
    displacement_P: np.ndarray | None = None  # int32: |step - batch of the sample|
    # float64 [R]: the ranks' relative speeds the plan is judged by (PlannerConfig.rank_speed);
    # None: equal. Costs above are work; a rank's time is its cost / its speed.
    speed_R: np.ndarray | None = None
    # int64 [P]: tokens of each placement's slice of a split sample when the slices are sized
    # by the ranks' speeds (``balancer.speed_split``; 0 on whole samples). None: equal slices
    # (``slice_tokens``, the sequence padded to a multiple of k).
    sp_tokens_P: np.ndarray | None = None
    # int64 [P]: the query heads each placement's rank attends of a split sample whose heads
    # are sized by the ranks' speeds (``balancer.speed_split.split_parts``; 0 elsewhere).
    # None: H/k heads each everywhere.
    sp_heads_P: np.ndarray | None = None

    @property
    def rank_cost_R(self) -> np.ndarray:
        return self.mb_cost_RB.sum(axis=1)

    @property
    def mb_time_RB(self) -> np.ndarray:
        """Predicted time of each rank's micro-batch, in cost units of a speed-1 rank."""
        return self.mb_cost_RB if self.speed_R is None \
            else self.mb_cost_RB / self.speed_R[:, None]

    @property
    def rank_time_R(self) -> np.ndarray:
        return self.mb_time_RB.sum(axis=1)

    @property
    def imbalance(self) -> float:
        """max/mean of the per-rank time (1.0 is perfect; the cost when ranks are equal)."""
        time_R = self.rank_time_R
        mean = time_R.mean()
        return float(time_R.max() / mean) if mean > 0 else 1.0

    @property
    def fsdp_time(self) -> float:
        """Step time when ranks synchronise every micro-batch: sum over slots of the max."""
        return float(self.mb_time_RB.max(axis=0).sum()) if self.mb_cost_RB.size else 0.0

    @property
    def ddp_time(self) -> float:
        """Step time when ranks synchronise once per step: the max rank time."""
        return float(self.rank_time_R.max()) if self.mb_cost_RB.size else 0.0

    def samples(self) -> np.ndarray:
        return np.unique(self.sample_P)

    def micro_batches(self, rank: int) -> list[np.ndarray]:
        """The rank's micro-batches in slot order, each an array of sample indices."""
        mine = self.rank_P == rank
        return [self.sample_P[mine & (self.micro_batch_P == b)]
                for b in range(self.num_micro_batches)]
