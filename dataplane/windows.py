"""From the mixer's global batches to the balancer's arrays and back.

A window is W consecutive global batches planned together. This module turns its samples (the
mixer's batch tables) into a :class:`balancer.types.WindowSamples` (tokens, source, batch, and
one encoder item per image, video clip and audio clip), runs the planner, and re-plans the tail
of a window on a different number of ranks (an elastic restore mid-window) without touching its
head; :class:`Window` is one drawn and planned window as the plane keeps it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omniscale.balancer.baselines import (
    BASELINES,
    BASELINES_NO_SPLIT,
    SPLIT_SUFFIX,
    split_sizes,
)
from omniscale.balancer.cost import Costs
from omniscale.balancer.planner import plan_step, plan_window_and_split
from omniscale.balancer.types import PlannerConfig, StepPlan, WindowSamples
from omniscale.geometry import MediaGeometry, audio_tokens
from omniscale.refs import REF_SCHEMA, RefTable, SampleRef, int_column


def window_samples(batches: "list[pa.Table | list[SampleRef]]", geometry: MediaGeometry
                   ) -> WindowSamples:
    """The window's samples in batch order; items in the order plan_table.item_kinds gives.

    ``batches``: each global batch as the mixer drew it (``Mixer.next_batch_table``, or its
    refs). Column at a time: each sample's items are its images, then videos, then audio
    clips, at ``item_offsets_N1[n]`` on."""
    tables = [RefTable.of(batch).table for batch in batches]
    table = pa.concat_tables(tables) if tables else REF_SCHEMA.empty_table()
    N = table.num_rows
    batch_N = np.repeat(np.arange(len(tables), dtype=np.int32), [t.num_rows for t in tables])
    lists = [table.column(name) for name in ("image_patches", "video_patches", "audio_frames")]
    count_KN = np.array([int_column(pc.list_value_length(values)) for values in lists],
                        np.int64).reshape(3, N)
    offsets_N1 = np.concatenate([[0], np.cumsum(count_KN.sum(axis=0), dtype=np.int64)]
                                ).astype(np.int64)
    M = int(offsets_N1[-1])
    size_M, kind_M, tokens_M = np.zeros(M, np.int64), np.zeros(M, np.int8), np.zeros(M, np.int64)
    first_N = offsets_N1[:-1].copy()  # where each sample's items of the next kind begin
    merge = geometry.merge_size ** 2
    for kind, values in enumerate(lists):
        count_N = count_KN[kind]
        total = int(count_N.sum())
        if total:
            flat = int_column(pc.list_flatten(values))
            # item j of a sample's items of this kind sits at first_N + j
            starts = np.cumsum(count_N) - count_N
            at = np.repeat(first_N - starts, count_N) + np.arange(total)
            size_M[at], kind_M[at] = flat, kind
            tokens_M[at] = audio_tokens(flat) if kind == 2 else flat // merge
        first_N += count_N
    return WindowSamples(
        tokens_N=int_column(table.column("llm_tokens")),
        source_N=int_column(table.column("source_id")).astype(np.int32),
        batch_N=batch_N, item_offsets_N1=offsets_N1, item_size_M=size_M, item_kind_M=kind_M,
        item_tokens_M=tokens_M)


def subset(samples: WindowSamples, idx_n: np.ndarray, batch_n: np.ndarray
           ) -> tuple[WindowSamples, np.ndarray]:
    """The samples ``idx_n`` alone (with new batch numbers), and the window item id of each of
    the subset's items."""
    off = samples.item_offsets_N1
    idx_n = np.asarray(idx_n, np.int64)
    count_n = off[idx_n + 1] - off[idx_n]
    # each sample's run of item ids, concatenated: a run starts at off[i], at its place in m
    item_m = np.repeat(off[idx_n] - (np.cumsum(count_n) - count_n), count_n) + \
        np.arange(int(count_n.sum()), dtype=np.int64)
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
        plans, sizes_N = plan_window_and_split(samples, costs, config)
        if config.sp_max > 1:  # the window's baselines are reported with it: not decided again
            _remember_split(samples, costs, config, sizes_N)
        return plans
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
    given), or None when nothing may split.

    The plane asks :func:`best_baseline` once per step of a window, each time for the same
    window-wide split: the last one is kept (with the samples it was computed for, so their
    identity cannot be reused) and given again while the samples, costs and settings are the
    same ones (a tenth of a 4,096-rank window's baselines otherwise)."""
    if config.sp_max <= 1:
        return None
    last = _last_split
    if last is not None and last[0] is samples and last[1] == costs and last[2] == config:
        return last[3]
    return _remember_split(samples, costs, config,
                           split_sizes(samples, costs, config, n_steps=config.window))


def _remember_split(samples: WindowSamples, costs: Costs, config: PlannerConfig,
                    sizes_N: np.ndarray) -> np.ndarray:
    """Keep the window's split for ``_window_split`` (the planner's, when the window was just
    planned: ``plan_policy``)."""
    global _last_split
    sizes_N = np.asarray(sizes_N, np.int64)
    sizes_N.flags.writeable = False  # shared by the calls that get it again
    _last_split = (samples, costs, config, sizes_N)
    return sizes_N


_last_split: tuple | None = None  # (samples, costs, config, split) of _window_split's last


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
    refs: RefTable  # the window's samples in batch order
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
                                 config.policy_of(self.k))
        self.dp_of_step[local:] = [dp] * (len(self.plans) - local)
        self.tables = {key: t for key, t in self.tables.items() if key[0] < step}
        self.prints = {key: f for key, f in self.prints.items() if key[0] < step}
