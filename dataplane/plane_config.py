"""The data plane's settings: ranks, micro-batch and global batch sizes, windows, SP splits,
snapshots and the cost model's starting coefficients (``omniscale plane serve`` flags, or the
trainer's ``data`` section). Invalid combinations are one-line UserErrors at construction."""

from __future__ import annotations

from dataclasses import dataclass

from omniscale.balancer.types import PlannerConfig
from omniscale.dataplane.errors import UserError

MAX_DP = 1 << 16
# the planner and the baselines of balancer.baselines (dataplane.windows.plan_policy)
POLICIES = ("omniscale", "strided", "first_fit", "token_lpt", "kk_cost")


@dataclass(frozen=True)
class PlaneConfig:
    dp: int
    micro_batch_tokens: int = 16384
    window: int = 4
    global_batch_tokens: int | None = None
    global_batch_samples: int | None = None
    sp_max: int = 8
    epsilon: float = 0.05
    snapshot_every: int = 100
    plan_ahead: int = 2  # windows planned beyond the one holding the first uncommitted step
    cost_linear: float = 24576.0
    cost_quadratic: float = 1.0
    # Longer samples are truncated (text only) or skipped (with media); default: the most one
    # SP group can hold, micro_batch_tokens x min(sp_max, ranks rounded down to a power of 2).
    max_sample_tokens: int | None = None
    # who places samples: the planner ("omniscale") or a baseline (windows.POLICIES), so a
    # run can train with a baseline's plans through the same plane (exactly-once all the same)
    balance: str = "omniscale"

    def __post_init__(self) -> None:
        if (self.global_batch_tokens is None) == (self.global_batch_samples is None):
            raise UserError("give exactly one of --global-batch-tokens and "
                            "--global-batch-samples")
        for name in ("dp", "micro_batch_tokens", "window", "snapshot_every"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')}: must be >= 1")
        if self.balance not in POLICIES:
            raise UserError(f"--balance {self.balance}: choose one of {', '.join(POLICIES)}")
        if self.dp > MAX_DP:
            raise UserError(f"--dp {self.dp}: at most {MAX_DP} ranks (every step plans a "
                            "table per rank)")
        PlannerConfig(dp=self.dp, micro_batch_tokens=self.micro_batch_tokens,
                      window=self.window, sp_max=self.sp_max, epsilon=self.epsilon)

    def planner(self, dp: int, window: int) -> PlannerConfig:
        return PlannerConfig(dp=dp, micro_batch_tokens=self.micro_batch_tokens, window=window,
                             sp_max=self.sp_max, epsilon=self.epsilon)

    @property
    def sample_cap(self) -> int:
        if self.max_sample_tokens is not None:
            return self.max_sample_tokens
        return self.micro_batch_tokens * min(self.sp_max, 1 << (self.dp.bit_length() - 1))

    @property
    def batch(self) -> dict:
        return {"global_batch_tokens": self.global_batch_tokens,
                "global_batch_samples": self.global_batch_samples}
