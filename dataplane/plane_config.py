"""The data plane's settings: ranks, micro-batch and global batch sizes, windows, SP splits,
snapshots and the cost model's starting coefficients (``omniscale plane serve`` flags, or the
trainer's ``data`` section). Invalid combinations are one-line UserErrors at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omniscale.balancer.cost import Costs
from omniscale.balancer.cost_file import SCALARS, costs_of
from omniscale.balancer.types import PlannerConfig
from omniscale.errors import UserError
from omniscale.media import MEDIA_KINDS

MAX_DP = 1 << 16
# the planner and the baselines of balancer.baselines (dataplane.windows.plan_policy)
# our planner, then the per-step baselines of balancer/baselines.py by name, then its static
# layouts (written out: importing the baselines costs the CLI numba at start-up;
# tests/dataplane/test_plane.py holds them equal)
POLICIES = ("omniscale", "strided", "first_fit", "token_lpt", "kk_cost", "static_sp")


def policy_of_window(balance: str, interleave, k: int) -> str:
    """The policy window ``k`` is planned by: ``interleave``'s turn, else ``balance`` (the
    plane plans by it; the trainer names it in the step's metrics row)."""
    return interleave[k % len(interleave)] if interleave else balance


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
    # A/B timing in one job: window k planned by interleave[k % n] instead of ``balance`` --
    # the policies take turns window by window, so a machine whose speed drifts over minutes
    # slows each alike (tools/bench/e2e.py's interleaved schedule). Empty: every window by
    # ``balance``.
    interleave: tuple[str, ...] = ()
    # a calibrated cost model (`omniscale balance calibrate`): α, β, γ of the LLM ("llm") and
    # of each encoder kind, in seconds, and optionally the fixed cost of a micro-batch
    # ("micro_batch") and of the collectives per token (COLLECTIVES); None prices encoders
    # relative to cost_linear/quadratic
    costs: dict | None = None
    # encoder kinds priced forward only (Costs.forward_only): their tower is frozen (the
    # trainer's optim.groups); MEDIA_KINDS names
    frozen_encoders: tuple[str, ...] = ()
    # each data rank's relative speed known ahead (mixed GPU generations): plans give a rank
    # work in proportion from step 0 (None: equal until measured speeds arrive, set_speeds);
    # kept relative to the fastest (1.0)
    rank_speed: tuple[float, ...] | None = None
    # the model's query heads on a rank (per TP rank): with speeds, a split sample's ranks may
    # attend heads in proportion to their speeds (``balancer.speed_split``); 0: not known,
    # H/k heads each
    attention_heads: int = 0

    def __post_init__(self) -> None:
        # a tuple however it came (a start record's JSON has a list), so restarts compare equal
        object.__setattr__(self, "frozen_encoders", tuple(self.frozen_encoders))
        object.__setattr__(self, "interleave", tuple(self.interleave))
        if self.rank_speed is not None:
            speeds = tuple(float(v) for v in self.rank_speed)
            if len(speeds) != self.dp or not all(math.isfinite(v) and v > 0 for v in speeds):
                raise UserError(f"--rank-speeds: one finite speed > 0 per data rank ({self.dp}),"
                                f" got {list(self.rank_speed)}")
            top = max(speeds)
            object.__setattr__(self, "rank_speed", tuple(round(v / top, 4) for v in speeds))
        unknown = sorted(set(self.frozen_encoders) - set(MEDIA_KINDS))
        if unknown:
            raise UserError(f"frozen_encoders: unknown encoder kinds {unknown} (known: "
                            f"{', '.join(MEDIA_KINDS)})")
        if (self.global_batch_tokens is None) == (self.global_batch_samples is None):
            raise UserError("give exactly one of --global-batch-tokens and "
                            "--global-batch-samples")
        if self.attention_heads < 0:
            raise UserError(f"--attention-heads: must be >= 0 (0: not known), got "
                            f"{self.attention_heads}")
        for name in ("dp", "micro_batch_tokens", "window", "snapshot_every"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')}: must be >= 1")
        if self.costs is not None:
            _check_costs(self.costs)
        if self.balance not in POLICIES:
            raise UserError(f"--balance {self.balance}: choose one of {', '.join(POLICIES)}")
        unknown = [p for p in self.interleave if p not in POLICIES]
        if unknown or len(self.interleave) == 1:
            raise UserError(f"--interleave {','.join(self.interleave)}: two or more of "
                            f"{', '.join(POLICIES)}" + (f" ({unknown[0]!r} is not one)"
                                                        if unknown else ""))
        if self.dp > MAX_DP:
            raise UserError(f"--dp {self.dp}: at most {MAX_DP} ranks (every step plans a "
                            "table per rank)")
        PlannerConfig(dp=self.dp, micro_batch_tokens=self.micro_batch_tokens,
                      window=self.window, sp_max=self.sp_max, epsilon=self.epsilon)

    def cost_model(self, linear: float, quadratic: float) -> Costs:
        """The planner's costs with the LLM's ``linear·L + quadratic·L²`` (the refit may move
        them during a run): a calibrated model's γ and encoders, or encoders relative to it."""
        if self.costs is None:
            costs = Costs.from_llm(linear, quadratic)
        else:
            costs = costs_of(self.costs, linear, quadratic)
        return costs.forward_only(self.frozen_encoders) if self.frozen_encoders else costs

    def policy_of(self, k: int) -> str:
        """The policy window ``k`` is planned by."""
        return policy_of_window(self.balance, self.interleave, k)

    def planner(self, dp: int, window: int,
                speeds: tuple[float, ...] | None = None) -> PlannerConfig:
        return PlannerConfig(dp=dp, micro_batch_tokens=self.micro_batch_tokens, window=window,
                             sp_max=self.sp_max, epsilon=self.epsilon, rank_speed=speeds,
                             n_heads=self.attention_heads)

    @property
    def sample_cap(self) -> int:
        if self.max_sample_tokens is not None:
            return self.max_sample_tokens
        return self.micro_batch_tokens * min(self.sp_max, 1 << (self.dp.bit_length() - 1))

    @property
    def batch(self) -> dict:
        return {"global_batch_tokens": self.global_batch_tokens,
                "global_batch_samples": self.global_batch_samples}


def _check_costs(costs: dict) -> None:
    for name in SCALARS:
        value = costs.get(name, 0.0)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise UserError(f"--costs: {name}: expected a finite number >= 0, got {value!r}")
    for name in ("llm", *MEDIA_KINDS):
        value = costs.get(name)
        if not (isinstance(value, (list, tuple)) and len(value) == 3 and
                all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                    for v in value)):
            raise UserError(f"--costs: {name}: expected three finite coefficients >= 0 "
                            f"(alpha, beta, gamma), got {value!r}")
