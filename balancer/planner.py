"""The planner: a window of samples in, one StepPlan per step out.

split (long-short) → reorder (over the window's steps) → assign (ranks) → pack (micro-batches)
→ encoder plan. Pure and deterministic: the same samples, costs and config give identical plans,
which is what lets the data plane re-plan a step after a restart instead of storing it.

Shape suffixes: N samples of the window (n of one step), M encoder items, P placements,
R ranks, B micro-batch slots.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from omniscale.balancer.assign import assign_ranks
from omniscale.balancer.cost import Costs
from omniscale.balancer.encoder_plan import plan_encoders
from omniscale.balancer.pack import pack
from omniscale.balancer.reorder import reorder_window
from omniscale.balancer.speed_split import head_fractions, part_costs, slice_lengths, split_parts
from omniscale.balancer.split import choose_sp_size, slot_share, unit_cost
from omniscale.balancer.types import PlannerConfig, StepPlan, WindowSamples, slice_tokens


def plan_window(samples: WindowSamples, costs: Costs, config: PlannerConfig) -> list[StepPlan]:
    """One StepPlan per global batch of the window: `config.window` of them, steps 0..W-1.

    A sample may run in any step of its window (displacement ≤ W-1) and on any rank. The split
    is decided for the whole window (``_choose_split``). A short last window is planned with
    `window` set to its length.
    """
    return plan_window_and_split(samples, costs, config)[0]


def plan_window_and_split(samples: WindowSamples, costs: Costs, config: PlannerConfig
                          ) -> tuple[list[StepPlan], np.ndarray]:
    """``plan_window``'s plans and the window's split (``window_split``'s answer for it), for
    a caller that gives the baselines the same split without deciding it again."""
    samples.validate()
    n_steps = config.window
    if samples.num_samples and int(samples.batch_N.max()) >= n_steps:
        raise ValueError(f"batch_N: batch {int(samples.batch_N.max())} is outside a window of "
                         f"{n_steps} batches")
    item_cost_M = costs.item_cost(samples.item_size_M, samples.item_kind_M)
    chosen = _choose_split(samples, n_steps, item_cost_M, costs, config, reorder=True)
    index_N = np.arange(samples.num_samples)
    return [chosen.first_plan if s == 0 else
            _plan_one(samples, index_N[chosen.step_N == s], s, chosen.sp_size_N, chosen.unit_N,
                      item_cost_M, costs, config) for s in range(n_steps)], chosen.sp_size_N


def plan_step(samples: WindowSamples, costs: Costs, config: PlannerConfig,
              step: int = 0) -> StepPlan:
    """All of `samples` as one step (no reordering): the window = 1 case, and the unit under
    test for assignment and packing. Displacement is measured against `samples.batch_N`."""
    samples.validate()
    item_cost_M = costs.item_cost(samples.item_size_M, samples.item_kind_M)
    return _choose_split(samples, 1, item_cost_M, costs, config, reorder=False,
                         step=step).first_plan


def window_split(samples: WindowSamples, costs: Costs, config: PlannerConfig,
                 n_steps: int = 1) -> np.ndarray:
    """SP group size of every sample (int32, 1 = whole) as the planner decides it for a window
    of ``n_steps`` steps of these samples (1: as ``plan_step`` does, without reordering): what
    the baselines are given, so that every policy runs the same split."""
    item_cost_M = costs.item_cost(samples.item_size_M, samples.item_kind_M)
    return _choose_split(samples, n_steps, item_cost_M, costs, config,
                         reorder=n_steps > 1).sp_size_N


class _Split(NamedTuple):
    sp_size_N: np.ndarray
    unit_N: np.ndarray  # the cost each of a sample's ranks carries (``split.unit_cost``)
    step_N: np.ndarray  # the step each sample runs in
    first_plan: StepPlan  # step 0's plan, made while choosing


def _choose_split(samples: WindowSamples, n_steps: int, item_cost_M: np.ndarray, costs: Costs,
                  config: PlannerConfig, *, reorder: bool, step: int = 0) -> _Split:
    """The window's split: of two rules, the one whose plan of the first step is predicted
    shorter (``_step_time``: communication and fixed costs included).

    The share rule (``split.choose_sp_size`` with the window's ``slot_share``) splits a sample
    costlier than what one rank carries in a micro-batch slot, so that no slice sets a slot's
    height alone; but every split pays its slice's all-to-all, and where the other ranks can
    fill the slots around a costly whole sample anyway (many short samples beside a few long
    ones) that communication buys nothing. The budget rule splits only what the micro-batch
    budget forces. Where the rules agree the window is planned once; where they differ, step
    0 of the share rule's reordering is planned under both and the window follows the shorter
    plan: one step planned again, and the window reordered again when the budget rule wins
    (its step 0 planned a third time only where that reordering changed step 0's samples).
    """
    cost_N, tokens_N = costs.llm(samples.tokens_N), samples.tokens_N
    share = slot_share(cost_N, tokens_N, n_steps, config.dp, config.micro_batch_tokens)
    rule = dict(sp_max=config.sp_max, dp=config.dp, micro_batch_tokens=config.micro_batch_tokens,
                sp_comm_per_token=costs.sp_comm_per_token)

    def steps_of(sp_size_N, unit_N):
        if not reorder:
            return np.zeros(samples.num_samples, np.int32)
        return reorder_window(tokens_N, samples.source_N, samples.batch_N, unit_N * sp_size_N,
                              unit_N, n_steps, config.epsilon).step_N

    def split(sp_size_N, step_N=None, planned: _Split | None = None) -> _Split:
        unit_N = unit_cost(cost_N, tokens_N, sp_size_N, costs.sp_comm_per_token)
        step_N = steps_of(sp_size_N, unit_N) if step_N is None else step_N
        first_n = np.flatnonzero(step_N == 0)
        if planned is not None and np.array_equal(first_n, np.flatnonzero(planned.step_N == 0)):
            # the same samples with the same split: the plan is a function of these alone
            return _Split(sp_size_N, unit_N, step_N, planned.first_plan)
        return _Split(sp_size_N, unit_N, step_N,
                      _plan_one(samples, first_n, step, sp_size_N, unit_N, item_cost_M, costs,
                                config))

    by_share = split(choose_sp_size(cost_N, tokens_N, share, **rule))
    by_budget_N = choose_sp_size(cost_N, tokens_N, np.inf, **rule)
    if np.array_equal(by_share.sp_size_N, by_budget_N):
        return by_share
    trial = split(by_budget_N, by_share.step_N)  # the same samples under the budget rule
    if _plan_time(trial.first_plan, costs, config) >= _plan_time(by_share.first_plan, costs,
                                                                 config):
        return by_share
    # reordered for the budget rule's costs: step 0 planned again only if its samples changed
    return split(by_budget_N, planned=trial) if reorder else trial


def _plan_time(plan: StepPlan, costs: Costs, config: PlannerConfig) -> float:
    return _step_time(plan.mb_cost_RB, costs.micro_batch, config.speed_R, config.sync)


class Placement(NamedTuple):
    """One step's samples on ranks and in slots (what ``_place`` chooses, ``_pack`` fills)."""

    first_n: np.ndarray  # the first rank of each sample (of its SP group when split)
    slot_n: np.ndarray  # its micro-batch slot
    tokens_RB: np.ndarray  # tokens per (rank, slot)
    cost_RB: np.ndarray  # cost (work units) per (rank, slot)
    n_slots: int
    # with speeds: each placement's slice length (0 for a whole sample) and query heads
    # (``StepPlan.sp_tokens_P``, ``sp_heads_P``); None without speeds (heads None too when
    # every split has H/k each)
    length_p: np.ndarray | None
    heads_p: np.ndarray | None


def _place(unit_n, k_n, slice_n, tokens_n, costs: Costs, config: PlannerConfig) -> Placement:
    """Ranks and slots for one step's samples.

    The assignment balances time per rank (cost / speed: ``config.rank_speed``), the step
    time when ranks meet once a step. Where they meet every micro-batch (``config.sync``
    ``"micro_batch"``: FSDP's gathers, the SP and EP all-to-alls), a step is Σ over slots of
    the slowest rank, and a rank holding a few long pieces beside others' many short ones sets
    the height of its slots: on equal ranks, an assignment that balances tokens alone (long
    pieces spread like short ones, so the slots fill alike) is tried too. A balance by cost can
    also give a rank more tokens than the fewest micro-batches hold, and then every rank runs
    one micro-batch more: when a micro-batch has a fixed cost (``costs.micro_batch``), an
    assignment that keeps every rank within the fewest micro-batches' tokens is tried as well.
    The plan with the shorter predicted step (``_step_time``) is kept. With speeds, a split
    sample's slices are sized by its group's speeds (``balancer.speed_split``).
    """
    dp, budget, speed_R = config.dp, config.micro_batch_tokens, config.speed_R
    bounds = None if speed_R is None else _slice_bounds(unit_n, k_n, tokens_n, costs, budget,
                                                        config.n_heads)
    first_n, _ = assign_ranks(unit_n, k_n, dp, speed_R=speed_R, slice_bounds=bounds)
    candidates = [_pack(first_n, k_n, slice_n, unit_n, tokens_n, bounds, costs, config)]
    if config.sync == "micro_batch" and speed_R is None and dp > 1:
        first_t, _ = assign_ranks(slice_n.astype(np.float64), k_n, dp, search_iters=0)
        candidates.append(_pack(first_t, k_n, slice_n, unit_n, tokens_n, None, costs, config,
                                extra_slots=0))
    fewest = -(-int((slice_n * k_n).sum()) // (dp * budget))
    if costs.micro_batch > 0 and candidates[0].n_slots > fewest:
        first_c, _ = assign_ranks(unit_n, k_n, dp, slice_tokens_N=slice_n,
                                  token_cap=fewest * budget, speed_R=speed_R,
                                  slice_bounds=bounds)
        candidates.append(_pack(first_c, k_n, slice_n, unit_n, tokens_n, bounds, costs, config))
    return min(candidates, key=lambda p: _step_time(p.cost_RB, costs.micro_batch, speed_R,
                                                    config.sync))


def _slice_bounds(unit_n, k_n, tokens_n, costs: Costs, budget: int, n_heads: int = 0):
    """Per sample: its attention share of the work a split spreads (the cost model's quadratic
    term over k × unit cost), and the least and most token fraction of a slice (one token; the
    micro-batch budget); then the model's query heads (0: unknown, H/k each)."""
    attn_n = costs.llm.beta * tokens_n.astype(np.float64) ** 2
    share_n = np.clip(attn_n / np.maximum(unit_n * k_n, 1e-300), 0.0, 1.0)
    return share_n, 1.0 / tokens_n, np.minimum(1.0, budget / tokens_n), int(n_heads)


def _pack(first_n, k_n, slice_n, unit_n, tokens_n, bounds, costs: Costs,
          config: PlannerConfig, extra_slots: int = 1) -> Placement:
    """``pack`` by time: with speeds, each sample's cost over its rank's speed (a split one's
    longest part over its rank's speed), so the slots' heights are the times ranks wait for;
    then the grid back in cost (work) units, with each part and slice on its rank."""
    speed_R = config.speed_R
    if speed_R is None:
        return Placement(first_n, *pack(first_n, k_n, slice_n, unit_n, config.dp,
                                        config.micro_batch_tokens, extra_slots,
                                        costs.micro_batch), None, None)
    inv_R = 1.0 / speed_R
    rank_p = np.repeat(first_n, k_n) + np.arange(int(k_n.sum())) \
        - np.repeat(np.cumsum(k_n) - k_n, k_n)
    part_p = np.repeat(unit_n, k_n).astype(np.float64)
    length_p = np.repeat(slice_n, k_n).astype(np.int64)
    share_n, lo_n, hi_n, n_heads = bounds
    heads_p = np.zeros(len(part_p), np.int64)
    start_n = np.cumsum(k_n) - k_n
    for i in np.flatnonzero(k_n > 1).tolist():
        f, k, at = int(first_n[i]), int(k_n[i]), int(start_n[i])
        t_K, h_K = split_parts(share_n[i], speed_R[f:f + k], lo_n[i], hi_n[i], n_heads)
        length_K = slice_lengths(int(tokens_n[i]), t_K, config.micro_batch_tokens)
        length_p[at:at + k] = length_K
        heads_p[at:at + k] = h_K
        part_p[at:at + k] = part_costs(unit_n[i] * k, share_n[i],
                                       length_K / float(tokens_n[i]), head_fractions(h_K))
    time_p = part_p * inv_R[rank_p]
    group_p = np.repeat(np.arange(len(k_n)), k_n)
    time_n = np.zeros(len(k_n))
    np.maximum.at(time_n, group_p, time_p)
    widest_n = np.zeros(len(k_n), np.int64)
    np.maximum.at(widest_n, group_p, length_p)
    slot_n, _, _, n_slots = pack(first_n, k_n, widest_n, time_n, config.dp,
                                 config.micro_batch_tokens, 1, costs.micro_batch)
    cost_RB = np.zeros((config.dp, n_slots), np.float64)
    tok_RB = np.zeros((config.dp, n_slots), np.int64)
    np.add.at(cost_RB, (rank_p, slot_n[group_p]), part_p)
    np.add.at(tok_RB, (rank_p, slot_n[group_p]), length_p)
    split_p = np.repeat(k_n > 1, k_n)
    return Placement(first_n, slot_n, tok_RB, cost_RB, n_slots, np.where(split_p, length_p, 0),
                     heads_p if heads_p.any() else None)


def _step_time(cost_RB: np.ndarray, micro_batch: float, speed_R: np.ndarray | None = None,
               sync: str = "micro_batch") -> float:
    """Predicted step, a rank's time its cost over its speed, plus every slot's fixed cost:
    Σ over slots of the slowest rank when ranks meet every micro-batch, the slowest rank's
    sum when they meet once a step."""
    if not cost_RB.size:
        return 0.0
    time_RB = cost_RB if speed_R is None else cost_RB / speed_R[:, None]
    waited = time_RB.max(axis=0).sum() if sync == "micro_batch" else time_RB.sum(axis=1).max()
    return float(waited + micro_batch * cost_RB.shape[1])


BALANCING_SPLITS = 2  # whole samples a step may split to follow the ranks' speeds
BALANCING_CANDIDATES = 3  # the costliest whole samples of the slowest rank tried for each
# Each try re-places the step: tried on jobs of up to this many data ranks, where a step deals
# few samples a rank (a larger job's whole samples follow the speeds more finely, and its
# planning time would grow by the tries)
BALANCING_MAX_DP = 64


def _split_to_balance(placed, unit_n, k_n, slice_n, tokens_n, costs: Costs,
                      config: PlannerConfig):
    """With speeds, a step of few samples cannot always be dealt in proportion (two ranks, four
    long samples each: shares move in quarters). Splitting one of the slowest rank's whole
    samples over an SP group of 2 lets its slices be sized to the speeds
    (``balancer.speed_split``), at the price of its all-to-alls: the costliest few whole
    samples on the rank that finishes last are tried, and the split kept when the predicted
    step (in time, fixed costs and communication included) is shorter by more than 1 %; up
    to ``BALANCING_SPLITS`` times, on jobs of up to ``BALANCING_MAX_DP`` data ranks.
    Returns (placed, unit_n, k_n, slice_n)."""
    speed_R = config.speed_R
    if speed_R is None or speed_R.min() == speed_R.max() or min(config.sp_max, config.dp) < 2 \
            or config.dp > BALANCING_MAX_DP:  # equal ranks: planned as without speeds
        return placed, unit_n, k_n, slice_n
    best = _step_time(placed.cost_RB, costs.micro_batch, speed_R, config.sync)
    for _ in range(BALANCING_SPLITS):
        time_R = (placed.cost_RB / speed_R[:, None]).sum(axis=1)
        slowest = int(np.argmax(time_R))
        first_n = placed.first_n
        mine = np.flatnonzero((k_n == 1) & (first_n == slowest) & (tokens_n >= 2))
        tried = None
        for i in mine[np.argsort(-unit_n[mine], kind="stable")][:BALANCING_CANDIDATES].tolist():
            k2, unit2, slice2 = k_n.copy(), unit_n.copy(), slice_n.copy()
            k2[i] = 2
            unit2[i] = unit_cost(unit_n[i:i + 1], tokens_n[i:i + 1], k2[i:i + 1],
                                 costs.sp_comm_per_token)[0]
            slice2[i] = slice_tokens(int(tokens_n[i]), 2)
            trial = _place(unit2, k2, slice2, tokens_n, costs, config)
            time = _step_time(trial.cost_RB, costs.micro_batch, speed_R, config.sync)
            if time < best * 0.99 and (tried is None or time < tried[0]):
                tried = (time, trial, unit2, k2, slice2)
        if tried is None:
            break
        best, placed, unit_n, k_n, slice_n = tried
    return placed, unit_n, k_n, slice_n


def _plan_one(samples: WindowSamples, idx_n: np.ndarray, step: int, sp_size_N: np.ndarray,
              unit_N: np.ndarray, item_cost_M: np.ndarray, costs: Costs,
              config: PlannerConfig) -> StepPlan:
    """Assign, pack and plan encoders for the samples `idx_n` (sorted window indices)."""
    dp = config.dp
    k_n = sp_size_N[idx_n].astype(np.int64)
    unit_n = np.ascontiguousarray(unit_N[idx_n], np.float64)
    slice_n = np.asarray(slice_tokens(samples.tokens_N[idx_n], k_n), np.int64)
    tokens_n = np.asarray(samples.tokens_N[idx_n], np.int64)
    placed = _place(unit_n, k_n, slice_n, tokens_n, costs, config)
    placed, unit_n, k_n, slice_n = _split_to_balance(placed, unit_n, k_n, slice_n, tokens_n,
                                                     costs, config)
    first_n, slot_n, tok_RB, cost_RB, n_slots, length_p, heads_p = placed
    # One placement per slice: sample i split over k ranks has rows sp_index 0..k-1 on the
    # ranks first..first+k-1, all in the same slot.
    group_p = np.repeat(np.arange(len(idx_n)), k_n)
    start_n = np.cumsum(k_n) - k_n
    sp_index_p = np.arange(len(group_p)) - start_n[group_p]
    rank_p = first_n[group_p] + sp_index_p
    order_P = np.lexsort((sp_index_p, idx_n[group_p], slot_n[group_p], rank_p))
    group_P = group_p[order_P]
    sample_P = idx_n[group_P].astype(np.int64)
    # Encoder items of the step's samples, consumed where slice 0 of their sample runs.
    offsets = samples.item_offsets_N1
    count_n = offsets[idx_n + 1] - offsets[idx_n]
    owner_m = np.repeat(np.arange(len(idx_n)), count_n)
    item_m = (offsets[idx_n][owner_m] + np.arange(len(owner_m))
              - (np.cumsum(count_n) - count_n)[owner_m]).astype(np.int64)
    consume_m = first_n[owner_m].astype(np.int32)
    speed_R = config.speed_R
    enc = plan_encoders(item_cost_M[item_m], samples.item_tokens_M[item_m], consume_m, dp,
                        costs.reshard_per_token, speed_R=speed_R)
    total = float((unit_n * k_n).sum())
    fastest = 1.0 if speed_R is None else float(speed_R.max())
    pooled = dp if speed_R is None else float(speed_R.sum())
    return StepPlan(
        step=step,
        sample_P=sample_P,
        rank_P=rank_p[order_P].astype(np.int32),
        micro_batch_P=slot_n[group_P].astype(np.int32),
        sp_size_P=k_n[group_P].astype(np.int32),
        sp_index_P=sp_index_p[order_P].astype(np.int32),
        num_micro_batches=int(n_slots),
        mb_cost_RB=cost_RB,
        mb_tokens_RB=tok_RB,
        # in time: the work spread by speed, and the costliest sample on the fastest rank
        lower_bound=max(total / pooled, float(unit_n.max()) / fastest if len(unit_n) else 0.0),
        item_M=item_m,
        item_sample_M=idx_n[owner_m].astype(np.int64),
        encode_rank_M=enc.encode_rank_M,
        consume_rank_M=consume_m,
        encoder_cost_R=enc.encoder_cost_R,
        reshard=enc.reshard,
        displacement_P=np.abs(step - samples.batch_N[sample_P]).astype(np.int32),
        speed_R=speed_R,
        sp_tokens_P=None if length_p is None else length_p[order_P].astype(np.int64),
        sp_heads_P=None if heads_p is None else heads_p[order_P].astype(np.int64),
    )
