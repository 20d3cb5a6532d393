"""From the mixer's global batches to the balancer's arrays and back.

A window is W consecutive global batches planned together. This module turns its SampleRefs
into a :class:`balancer.types.WindowSamples` (tokens, source, batch, and one encoder item per
image, video clip and audio clip), runs the planner, and re-plans the tail of a window on a
different number of ranks (an elastic restore mid-window) without touching its head;
:class:`Window` is one drawn and planned window as the plane keeps it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from omniscale.balancer.baselines import (
    BASELINES,
    BASELINES_NO_SPLIT,
    SPLIT_SUFFIX,
    split_sizes,
)
from omniscale.balancer.cost import Costs
from omniscale.balancer.planner import plan_step, plan_window
from omniscale.balancer.types import PlannerConfig, StepPlan, WindowSamples
from omniscale.geometry import MediaGeometry, audio_tokens
from omniscale.refs import SampleRef


def window_samples(batches: list[list[SampleRef]], geometry: MediaGeometry) -> WindowSamples:
    """The window's samples in batch order; items in the order plan_table.item_kinds gives."""
    refs = [ref for batch in batches for ref in batch]
    batch_N = np.repeat(np.arange(len(batches), dtype=np.int32), [len(b) for b in batches])
    sizes, kinds, tokens, counts = [], [], [], []
    merge = geometry.merge_size ** 2
    for ref in refs:
        counts.append(len(ref.image_patches) + len(ref.video_patches) + len(ref.audio_frames))
        for kind, values in ((0, ref.image_patches), (1, ref.video_patches)):
            sizes += values
            kinds += [kind] * len(values)
            tokens += [v // merge for v in values]
        sizes += ref.audio_frames
        kinds += [2] * len(ref.audio_frames)
        tokens += [audio_tokens(f) for f in ref.audio_frames]
    return WindowSamples(
        tokens_N=np.array([r.llm_tokens for r in refs], np.int64),
        source_N=np.array([r.source_id for r in refs], np.int32),
        batch_N=batch_N,
        item_offsets_N1=np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64),
        item_size_M=np.array(sizes, np.int64),
        item_kind_M=np.array(kinds, np.int8),
        item_tokens_M=np.array(tokens, np.int64))


def subset(samples: WindowSamples, idx_n: np.ndarray, batch_n: np.ndarray
           ) -> tuple[WindowSamples, np.ndarray]:
    """The samples ``idx_n`` alone (with new batch numbers), and the window item id of each of
    the subset's items."""
    off = samples.item_offsets_N1
    count_n = off[idx_n + 1] - off[idx_n]
    item_m = np.concatenate([np.arange(off[i], off[i + 1]) for i in idx_n]).astype(np.int64) \
        if len(idx_n) else np.zeros(0, np.int64)
    return WindowSamples(
        tokens_N=samples.tokens_N[idx_n], source_N=samples.source_N[idx_n],
        batch_N=batch_n.astype(np.int32),
        item_offsets_N1=np.concatenate([[0], np.cumsum(count_n)]).astype(np.int64),
        item_size_M=samples.item_size_M[item_m], item_kind_M=samples.item_kind_M[item_m],
        item_tokens_M=samples.item_tokens_M[item_m]), item_m


def plan_policy(samples: WindowSamples, costs: Costs, config: PlannerConfig,
                policy: str = "omniscale") -> list[StepPlan]:
    """The window's plans by ``policy``: the planner (``omniscale``: reorders samples between
    the window's steps) or a baseline of ``balancer.baselines`` (each global batch as drawn,
    placed its own way; with ``sp_max`` > 1 its ``+split`` variant, given exactly the
    planner's long-short split decided over the window: the same splitting)."""
    if policy == "omniscale":
        return plan_window(samples, costs, config)
    sizes_N = _window_split(samples, costs, config)
    plans = []
    for b in range(config.window):
        idx_n = np.flatnonzero(samples.batch_N == b)
        plans.append(_baseline_step(samples, idx_n, b, costs, config, policy,
                                    None if sizes_N is None else sizes_N[idx_n]))
    return plans


def _window_split(samples: WindowSamples, costs: Costs, config: PlannerConfig
                  ) -> np.ndarray | None:
    """The planner's long-short split decided over the whole window (what every baseline is
    given), or None when nothing may split."""
    return split_sizes(samples, costs, config, n_steps=config.window) \
        if config.sp_max > 1 else None


def _baseline_step(samples: WindowSamples, idx_n: np.ndarray, step: int, costs: Costs,
                   config: PlannerConfig, policy: str, sizes_n: np.ndarray | None) -> StepPlan:
    """Window samples ``idx_n`` placed as step ``step`` by the named baseline (``sizes_n``:
    their SP group sizes, None for no split)."""
    one_step = dataclasses.replace(config, window=1)
    sub, item_m = subset(samples, idx_n, np.zeros(len(idx_n), np.int64))
    if sizes_n is None:
        plan = BASELINES[policy](sub, costs, one_step)
    else:
        plan = BASELINES[policy + SPLIT_SUFFIX](sub, costs, one_step, sp_size_N=sizes_n)
    plan.speed_R = config.speed_R  # placed blind to speed, judged by it like the planner's
    return _to_window(plan, samples, idx_n, item_m, step)


def best_baseline(samples: WindowSamples, step: int, costs: Costs,
                  config: PlannerConfig) -> dict:
    """What the best baseline would predict for the window's global batch ``step`` as drawn
    (the planner may have moved samples between the window's steps): the least step cost
    (costliest rank) over the baselines, and which one. ``config``: the window's planner
    settings (the long-short split decided over the window, as ``plan_policy`` does)."""
    idx_n = np.flatnonzero(samples.batch_N == step)
    sizes_N = _window_split(samples, costs, config)
    # One rank: every placement puts the same samples on it at the same cost (up to the
    # order of a float sum), so the first baseline stands for all -- a quarter of a
    # single-rank plane's work per step otherwise.
    policies = list(BASELINES_NO_SPLIT)[:1] if config.dp == 1 else BASELINES_NO_SPLIT
    best: dict = {}
    for policy in policies:
        plan = _baseline_step(samples, idx_n, step, costs, config, policy,
                              None if sizes_N is None else sizes_N[idx_n])
        cost = plan.ddp_time  # in time: the ranks' speeds count (equal: the costliest rank)
        if not best or cost < best["baseline_step_cost"]:
            best = {"baseline": policy, "baseline_step_cost": cost}
    return best


def _to_window(plan: StepPlan, samples: WindowSamples, idx_n: np.ndarray, item_m: np.ndarray,
               step: int) -> StepPlan:
    """A plan of the subset ``idx_n`` back in window numbering, as step ``step``."""
    plan.step = step
    plan.sample_P = idx_n[plan.sample_P]
    plan.item_M = item_m[plan.item_M]
    plan.item_sample_M = idx_n[plan.item_sample_M]
    plan.displacement_P = np.abs(step - samples.batch_N[plan.sample_P]).astype(np.int32)
    return plan


def replan_tail(plans: list[StepPlan], samples: WindowSamples, from_step: int, costs: Costs,
                config: PlannerConfig, policy: str = "omniscale") -> list[StepPlan]:
    """Plans whose steps ``< from_step`` are kept and whose later steps are re-planned on
    ``config.dp`` ranks, each step with exactly the samples it had (steps are window-local).
    Used when a job resumes mid-window with a different number of ranks: what was trained
    stays trained, and every later step trains the same global batch as before (DESIGN.md:
    the same global batches re-planned onto the new ranks) -- only ranks and micro-batches
    change, so the run's loss curve does not depend on when it was resized. ``policy``: the
    run's (``plan_policy``)."""
    one_step = dataclasses.replace(config, window=1)
    fresh = []
    for plan in plans[from_step:]:
        idx_n = np.sort(plan.samples()).astype(np.int64)
        sub, item_m = subset(samples, idx_n, np.zeros(len(idx_n), np.int64))
        if policy == "omniscale":
            fresh.append(_to_window(plan_step(sub, costs, one_step, step=plan.step), samples,
                                    idx_n, item_m, plan.step))
        else:
            sizes_n = split_sizes(sub, costs, one_step) if config.sp_max > 1 else None
            fresh.append(_baseline_step(samples, idx_n, plan.step, costs, config, policy,
                                        sizes_n))
    return plans[:from_step] + fresh


@dataclass
class Window:
    """A drawn and planned window: its samples, its plans and the state it started from."""

    k: int
    first_step: int
    start_state: dict  # mixer state before drawing it
    spec_path: str
    refs: list[SampleRef]
    samples: WindowSamples
    plans: list[StepPlan]
    dp_of_step: list[int]
    tables: dict[tuple[int, int], pa.Table] = field(default_factory=dict)
    # plan_table.fingerprint of each table: every rank commit checks all of a step's, so
    # computing them per commit cost O(dp) hashes each, O(dp²) a step (0.8 s at 256 ranks)
    prints: dict[tuple[int, int], str] = field(default_factory=dict)

    @property
    def end_step(self) -> int:
        return self.first_step + len(self.plans)

    def resize(self, step: int, dp: int, costs: Costs, config,
               speeds: tuple[float, ...] | None = None) -> None:
        """Re-plan the steps from ``step`` on (those in this window) for ``dp`` ranks of
        relative ``speeds`` (None: equal)."""
        local = max(step - self.first_step, 0)
        if local >= len(self.plans):
            return
        self.plans = replan_tail(self.plans, self.samples, local, costs,
                                 config.planner(dp, len(self.plans) - local, speeds),
                                 config.balance)
        self.dp_of_step[local:] = [dp] * (len(self.plans) - local)
        self.tables = {key: t for key, t in self.tables.items() if key[0] < step}
        self.prints = {key: f for key, f in self.prints.items() if key[0] < step}
