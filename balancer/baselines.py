"""Per-step placement policies the planner is measured against, as other systems do it.

Each policy places one global batch (every sample of ``samples``, as drawn: no window, no
sequence-parallel split) on ``config.dp`` ranks and packs each rank into micro-batches under
``config.micro_batch_tokens``. A sample longer than the budget still runs, alone in its
micro-batch: the simulator counts that as a budget violation instead of refusing the policy.
Every plan has the same micro-batch count on every rank (empty trailing slots) and fills the
cost grid, lower bound and encoder cost the way the planner does, so metrics treat all alike.

- ``strided``: DistributedSampler: sample j to rank j mod dp, consecutive micro-batches;
- ``first_fit``: VeOmni-like dynamic batching: each rank takes a contiguous chunk of the
  batch and packs it first-fit in arrival order;
- ``token_lpt``: longest-processing-time on token counts, first-fit-decreasing packing;
- ``kk_cost``: verl-like equal-size Karmarkar–Karp on the cost ``α·L + β·L²`` (every rank
  gets the same number of samples, ±1), first-fit-decreasing packing.
"""

from __future__ import annotations

import heapq
from types import MappingProxyType

import numba
import numpy as np

from balancer.stream import item_costs, llm_costs
from balancer.types import PlannerConfig, StepPlan, WindowSamples


def strided(samples: WindowSamples, costs, config: PlannerConfig) -> StepPlan:
    """DistributedSampler-like: round-robin ranks, consecutive samples fill micro-batches."""
    n = samples.num_samples
    rank_N = (np.arange(n) % config.dp).astype(np.int64)
    mb_N = _pack(samples.tokens_N, rank_N, np.arange(n), config.dp,
                 config.micro_batch_tokens, False)
    return assemble(samples, costs, config, rank_N, mb_N)


def first_fit(samples: WindowSamples, costs, config: PlannerConfig) -> StepPlan:
    """Dynamic batching: contiguous chunks per rank, first-fit under the token budget."""
    n = samples.num_samples
    rank_N = np.arange(n, dtype=np.int64) * config.dp // max(n, 1)
    mb_N = _pack(samples.tokens_N, rank_N, np.arange(n), config.dp,
                 config.micro_batch_tokens, True)
    return assemble(samples, costs, config, rank_N, mb_N)


def token_lpt(samples: WindowSamples, costs, config: PlannerConfig) -> StepPlan:
    """Longest first onto the rank with the fewest tokens; first-fit-decreasing packing."""
    order_N = np.argsort(-samples.tokens_N, kind="stable")
    rank_N = _lpt(samples.tokens_N.astype(np.float64), order_N, config.dp)
    mb_N = _pack(samples.tokens_N, rank_N, order_N, config.dp, config.micro_batch_tokens, True)
    return assemble(samples, costs, config, rank_N, mb_N)


def kk_cost(samples: WindowSamples, costs, config: PlannerConfig) -> StepPlan:
    """Equal-size Karmarkar–Karp on the LLM cost (as verl balances its batches)."""
    rank_N = karmarkar_karp_equal(llm_costs(samples, costs), config.dp)
    order_N = np.argsort(-samples.tokens_N, kind="stable")
    mb_N = _pack(samples.tokens_N, rank_N, order_N, config.dp, config.micro_batch_tokens, True)
    return assemble(samples, costs, config, rank_N, mb_N)


BASELINES = MappingProxyType({
    "strided": strided, "first_fit": first_fit, "token_lpt": token_lpt, "kk_cost": kk_cost})


def karmarkar_karp_equal(value_N: np.ndarray, parts: int) -> np.ndarray:
    """Partition index of each value: ``parts`` parts of equal count (±1), sums close.

    The largest-differencing method over partial partitions: values sorted and cut into
    chunks of ``parts`` (one value per part, zeros padding the last chunk), then the two
    partial partitions with the largest spread are merged, heaviest part with lightest, until
    one is left. Deterministic: ties break by position.
    """
    n = len(value_N)
    padded = -(-n // parts) * parts
    order = np.argsort(value_N, kind="stable")
    ids = np.concatenate([order, np.full(padded - n, -1)]).astype(np.int64)
    vals = np.concatenate([np.asarray(value_N, np.float64)[order], np.zeros(padded - n)])
    heap = []
    for c in range(padded // parts):
        sums_K = vals[c * parts:(c + 1) * parts][::-1].copy()  # descending
        members_KC = ids[c * parts:(c + 1) * parts][::-1, None].copy()
        heapq.heappush(heap, (-(sums_K[0] - sums_K[-1]), c, sums_K, members_KC))
    rank_N = np.zeros(n, np.int64)
    if not heap:
        return rank_N
    tie = len(heap)
    while len(heap) > 1:
        _, _, sums_a, members_a = heapq.heappop(heap)
        _, _, sums_b, members_b = heapq.heappop(heap)
        sums_K = sums_a + sums_b[::-1]
        members_KC = np.concatenate([members_a, members_b[::-1]], axis=1)
        desc = np.argsort(-sums_K, kind="stable")
        sums_K, members_KC = sums_K[desc], members_KC[desc]
        heapq.heappush(heap, (-(sums_K[0] - sums_K[-1]), tie, sums_K, members_KC))
        tie += 1
    members_KC = heap[0][3]
    part_KC = np.broadcast_to(np.arange(parts)[:, None], members_KC.shape)
    real = members_KC >= 0
    rank_N[members_KC[real]] = part_KC[real]
    return rank_N


def assemble(samples: WindowSamples, costs, config: PlannerConfig, rank_N: np.ndarray,
             mb_N: np.ndarray) -> StepPlan:
    """The StepPlan of whole samples at (rank, micro-batch), costs and bound filled in.

    The lower bound is that of any placement without splitting: the mean rank cost and the
    dearest sample. Encoder items are encoded where they are consumed (no reshard).
    """
    n, dp = samples.num_samples, config.dp
    cost_N = llm_costs(samples, costs)
    slots = int(mb_N.max()) + 1 if n else 0
    mb_cost_RB = np.zeros((dp, slots), np.float64)
    mb_tokens_RB = np.zeros((dp, slots), np.int64)
    np.add.at(mb_cost_RB, (rank_N, mb_N), cost_N)
    np.add.at(mb_tokens_RB, (rank_N, mb_N), samples.tokens_N)
    item_sample_M = np.repeat(np.arange(n, dtype=np.int64), np.diff(samples.item_offsets_N1))
    consume_rank_M = rank_N[item_sample_M].astype(np.int32)
    encoder_cost_R = np.bincount(consume_rank_M, weights=item_costs(samples, costs),
                                 minlength=dp).astype(np.float64)
    return StepPlan(
        step=0, sample_P=np.arange(n, dtype=np.int64), rank_P=rank_N.astype(np.int32),
        micro_batch_P=mb_N.astype(np.int32), sp_size_P=np.ones(n, np.int32),
        sp_index_P=np.zeros(n, np.int32), num_micro_batches=slots, mb_cost_RB=mb_cost_RB,
        mb_tokens_RB=mb_tokens_RB,
        lower_bound=float(max(cost_N.sum() / dp, cost_N.max())) if n else 0.0,
        item_M=np.arange(samples.num_items, dtype=np.int64), item_sample_M=item_sample_M,
        encode_rank_M=consume_rank_M, consume_rank_M=consume_rank_M.copy(),
        encoder_cost_R=encoder_cost_R, reshard=False, displacement_P=np.zeros(n, np.int32))


@numba.njit(cache=True)
def _lpt(weight_N, order_N, ranks):
    """Rank of each sample when taken in ``order_N`` onto the least-loaded rank (lowest id)."""
    load_R = np.zeros(ranks, np.float64)
    rank_N = np.zeros(len(weight_N), np.int64)
    for i in order_N:
        r = np.argmin(load_R)
        rank_N[i] = r
        load_R[r] += weight_N[i]
    return rank_N


@numba.njit(cache=True)
def _pack(tokens_N, rank_N, order_N, ranks, budget, first):
    """Micro-batch of each sample, taking each rank's samples in ``order_N``.

    ``first``: first fit (the lowest slot with room, else a new one); otherwise consecutive
    (a new slot when the current one would overflow). A sample over the budget gets a slot of
    its own; nothing else joins it.
    """
    n = len(tokens_N)
    count_R = np.zeros(ranks, np.int64)
    for i in range(n):
        count_R[rank_N[i]] += 1
    load_RB = np.zeros((ranks, max(1, count_R.max())), np.int64)
    used_R = np.zeros(ranks, np.int64)
    mb_N = np.zeros(n, np.int64)
    for i in order_N:
        r, t = rank_N[i], tokens_N[i]
        slot = -1
        if first:
            for b in range(used_R[r]):
                if load_RB[r, b] + t <= budget:
                    slot = b
                    break
        elif used_R[r] and load_RB[r, used_R[r] - 1] + t <= budget:
            slot = used_R[r] - 1
        if slot < 0:
            slot = used_R[r]
            used_R[r] += 1
        load_RB[r, slot] += t
        mb_N[i] = slot
    return mb_N
