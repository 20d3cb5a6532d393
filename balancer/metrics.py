"""What a plan costs and whether it is valid, computed the same way for every policy.

Plans here are *global*: ``step`` is the absolute step and ``sample_P`` / ``item_M`` index the
whole stream (the simulator rewrites window-local plans), so displacement and exactly-once are
judged against the stream's arrival order, not taken from the policy's own report.

Step time adds the encoder phase to the LLM phase. With a reshard the ranks exchange
embeddings between the phases, so the phases synchronise separately (max + max); without one
a rank runs its encoder straight into its LLM work, so under DDP (one synchronisation a step)
its time is the max of the sums. FSDP synchronises every layer, so every phase and micro-batch
slot costs its slowest rank.
"""

from __future__ import annotations

import numpy as np

from omniscale.balancer.types import StepPlan, slice_tokens


def encoder_time_R(plan: StepPlan) -> np.ndarray:
    """Each rank's encoder work over its speed (the cost when ranks are equal); requires
    ``plan.encoder_cost_R``."""
    enc_R = plan.encoder_cost_R
    if plan.speed_R is not None and enc_R.shape == plan.speed_R.shape:
        enc_R = enc_R / plan.speed_R
    return enc_R


def step_times(plan: StepPlan) -> tuple[float, float]:
    """(DDP, FSDP) simulated time of one step, encoder phase included: each rank's work over
    its speed (``plan.speed_R``; equal ranks when None)."""
    llm_R = plan.rank_time_R if plan.mb_cost_RB.size else np.zeros(1)
    enc_R = encoder_time_R(plan) if plan.encoder_cost_R is not None else np.zeros_like(llm_R)
    enc_max = float(enc_R.max()) if enc_R.size else 0.0
    ddp = plan.ddp_time + enc_max if plan.reshard else float((llm_R + enc_R).max())
    return ddp, plan.fsdp_time + enc_max


FULL_CELL = 0.9  # a (rank, slot) cell holding this share of the token budget counts as full


def fsdp_breakdown(plans: list[StepPlan], tokens_N: np.ndarray, dp: int, budget: int,
                   ideal: float, reshard_S: np.ndarray | None = None,
                   micro_batch: float = 0.0) -> dict:
    """Where the FSDP step time goes, summed over the steps, each part over ``ideal``; the
    parts add up to the FSDP time over the ideal (`step_times` plus the reshard phase and the
    slots' fixed cost, as ``simulate.summarize`` adds them):

    - ``work``: every rank's LLM and encoder time over the ranks (on equal ranks 1 + the SP
      all-to-all's share: the ideal is compute alone);
    - ``slot_idle``: ranks waiting for the slowest in a micro-batch slot; of it,
      ``slot_idle_beside_splits`` in slots that hold a split sample's slice and
      ``slot_idle_in_full_cells`` on ranks whose slot holds >= ``FULL_CELL`` of the token
      budget (no room to fill the wait, whatever the planner did);
    - ``encoder_idle``: ranks waiting for the slowest in the encoder phase;
    - ``reshard``: the embeddings' all-to-all between the phases; ``fixed``: each slot's fixed
      cost (``micro_batch``).
    """
    parts = dict.fromkeys(("work", "slot_idle", "slot_idle_beside_splits",
                           "slot_idle_in_full_cells", "encoder_idle", "reshard", "fixed"), 0.0)
    for plan in plans:
        if plan.mb_cost_RB.size:
            time_RB = plan.mb_time_RB
            idle_RB = time_RB.max(axis=0)[None, :] - time_RB
            split_B = np.zeros(time_RB.shape[1], bool)
            split_B[plan.micro_batch_P[plan.sp_size_P > 1]] = True
            full_RB = recount_tokens(plan, tokens_N, dp)[:, :time_RB.shape[1]] \
                >= FULL_CELL * budget
            parts["work"] += float(time_RB.sum())
            parts["slot_idle"] += float(idle_RB.sum())
            parts["slot_idle_beside_splits"] += float(idle_RB[:, split_B].sum())
            parts["slot_idle_in_full_cells"] += float(idle_RB[full_RB].sum())
        if plan.encoder_cost_R is not None and plan.encoder_cost_R.size:
            enc_R = encoder_time_R(plan)
            parts["work"] += float(enc_R.sum())
            parts["encoder_idle"] += float((enc_R.max() - enc_R).sum())
        parts["fixed"] += micro_batch * plan.num_micro_batches * dp
    if reshard_S is not None:
        parts["reshard"] = float(np.sum(reshard_S)) * dp
    # all summed over ranks so far: a step's time is a rank's, the sum over dp ranks / dp
    return {key: value / dp / ideal if ideal > 0 else 0.0 for key, value in parts.items()}


def recount_tokens(plan: StepPlan, tokens_N: np.ndarray, dp: int) -> np.ndarray:
    """Tokens per (rank, slot) from the placements themselves (SP slices padded as planned,
    or cut by speed as planned)."""
    grid_RB = np.zeros((dp, max(plan.num_micro_batches, 1)), np.int64)
    tokens_P = slice_tokens(tokens_N[plan.sample_P], plan.sp_size_P)
    if plan.sp_tokens_P is not None:
        tokens_P = np.where(plan.sp_size_P > 1, plan.sp_tokens_P, tokens_P)
    np.add.at(grid_RB, (plan.rank_P, plan.micro_batch_P), tokens_P)
    return grid_RB


def violations(plan: StepPlan, tokens_N: np.ndarray, dp: int, budget: int) -> int:
    """Micro-batches (rank, slot) whose recounted tokens exceed the budget."""
    return int((recount_tokens(plan, tokens_N, dp) > budget).sum())


def displacement(plan: StepPlan, arrival_N: np.ndarray) -> np.ndarray:
    """Steps each placement moved from the step its sample was drawn for."""
    return np.abs(plan.step - arrival_N[plan.sample_P])


def exactly_once(plans: list[StepPlan], num_samples: int, num_items: int) -> dict:
    """Whether every sample ran once: in one step, on exactly k ranks with slices 0..k-1.

    Items are checked likewise when the plans carry an encoder plan (each item encoded once).
    Returns counts of missing and duplicated samples (and items) for the report.
    """
    sample_P = np.concatenate([p.sample_P for p in plans]) if plans else np.zeros(0, np.int64)
    size_P = np.concatenate([p.sp_size_P for p in plans]) if plans else np.zeros(0, np.int32)
    index_P = np.concatenate([p.sp_index_P for p in plans]) if plans else np.zeros(0, np.int32)
    step_P = np.concatenate([np.full(len(p.sample_P), p.step) for p in plans]) \
        if plans else np.zeros(0, np.int64)
    valid_P = (sample_P >= 0) & (sample_P < num_samples)
    out_of_range = int((~valid_P).sum())
    sample_P, size_P, index_P, step_P = (a[valid_P] for a in (sample_P, size_P, index_P, step_P))
    rows_N = np.bincount(sample_P, minlength=num_samples)
    size_N = np.zeros(num_samples, np.int64)
    size_N[sample_P] = size_P
    # Each slice index once: sum of indices over a sample's rows is 0+1+…+(k-1).
    index_sum_N = np.bincount(sample_P, weights=index_P, minlength=num_samples)
    first_N = np.full(num_samples, np.iinfo(np.int64).max)
    last_N = np.full(num_samples, -1)
    np.minimum.at(first_N, sample_P, step_P)
    np.maximum.at(last_N, sample_P, step_P)
    bad_N = (rows_N != size_N) | (index_sum_N != size_N * (size_N - 1) // 2) | (first_N != last_N)
    missing = int((rows_N == 0).sum())
    result = {"missing": missing, "duplicated": int((bad_N & (rows_N > 0)).sum()) + out_of_range}
    item_M = np.concatenate([p.item_M for p in plans]) if plans else np.zeros(0, np.int64)
    if num_items and len(item_M):
        counts_M = np.bincount(item_M, minlength=num_items)[:num_items]
        result.update(items_missing=int((counts_M == 0).sum()),
                      items_duplicated=int((counts_M > 1).sum()))
    result["ok"] = not any(v for k, v in result.items() if k != "ok")
    return result


def ideal_time(llm_cost_N: np.ndarray, item_cost_M: np.ndarray, dp: int,
               speed_R: np.ndarray | None = None) -> float:
    """All predicted cost spread perfectly over the ranks (in proportion to their speeds when
    given): the floor for any policy's total."""
    pooled = dp if speed_R is None else float(np.sum(speed_R))
    return float((llm_cost_N.sum() + item_cost_M.sum()) / pooled)
