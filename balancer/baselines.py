"""Per-step placement policies the planner is measured against, as other systems do it.

Each policy places one global batch (every sample of ``samples``, as drawn: no window) on
``config.dp`` ranks and packs each rank into micro-batches under ``config.micro_batch_tokens``.
Every plan has the same micro-batch count on every rank (empty trailing slots) and fills the
cost grid, lower bound and encoder cost the way the planner does, so metrics treat all alike.
Encoder items are encoded where they are consumed (no reshard).

Two variants of each policy:

- no split (``BASELINES_NO_SPLIT``): every sample whole on one rank. A sample longer than the
  budget still runs, alone in its micro-batch: the simulator counts that as a budget violation
  instead of refusing the policy.
- ``+split`` (``BASELINES_SPLIT``): first the planner's own long-short split (`split_sizes`:
  a sample longer than the budget, and where the planner finds it pays a sample costlier
  than a micro-batch slot's share, runs on an aligned SP group of k ranks, ``sp_max`` caps
  k, each rank carrying c/k plus its all-to-all cost); then the policy places whole samples
  and SP groups its own way. A group's k slices share one micro-batch slot on its k ranks.
  The split keeps every slice within the budget, so these plans never violate it.

The policies (their ``+split`` rule for SP groups in brackets):

- ``strided``: DistributedSampler: sample j to rank j mod dp, consecutive micro-batches [a
  cursor walks the ranks; a group takes the next aligned k ranks from it];
- ``first_fit``: VeOmni-like dynamic batching: each rank takes a contiguous chunk of the
  batch and packs it first-fit in arrival order [a group takes the aligned k ranks around its
  chunk's rank];
- ``token_lpt``: longest-processing-time on token counts, first-fit-decreasing packing [groups
  first, widest then longest, each onto the aligned group with the fewest tokens on its
  fullest rank; then whole samples by LPT on tokens];
- ``kk_cost``: verl-like equal-size Karmarkar–Karp on the cost ``α·L + β·L²`` (every rank
  gets the same number of samples, ±1), first-fit-decreasing packing [groups first, each onto
  the aligned group whose costliest rank is cheapest; whole samples partitioned by KK, the
  costliest part onto the least loaded rank].

Static layouts (``STATIC_LAYOUTS``): what a user of a system with a fixed parallel layout runs,
no per-sample split decision at all.

- ``static_sp``: every sequence sharded over an aligned SP group of k ranks, k the largest
  power of two ≤ ``sp_max`` and ≤ ``dp`` (torchtitan's context parallelism, VeOmni's and
  DeepSpeed's Ulysses SP: the SP degree is a property of the job, not of the sample).
  Each rank holds ⌈L/k⌉ tokens of every sample and pays c/k plus its all-to-all. Samples go
  to the dp/k groups by LPT on tokens, longest first, and are packed first-fit-decreasing
  under the per-rank budget (at least as good as those systems' own packers: fewest slots).
  Its media items are placed by the planner's own encoder plan (``plan_encoders``: LPT over
  every rank, embeddings moved only when that pays by ``costs.reshard_per_token``), as VeOmni
  shards its vision tower's input over the SP group; encoding everything on slice 0's rank
  would pile a group's media on one rank. It answers to ``static_sp+split`` too, because
  ``dataplane.windows.plan_policy`` asks for that name whenever ``sp_max`` > 1; the split it
  is then given is ignored (the layout decides every group size). With ``sp_max`` = 1, k = 1:
  the static layout without SP, where a sample longer than the budget cannot run -- it is
  placed alone in its micro-batch and counted as a budget violation, as the no-split
  baselines are. A real run without SP cannot train such a sample at all: the data plane
  truncates text to the budget and skips longer media samples (its ``max_sample_tokens``),
  so on long-tailed data "no SP" trains different data and is no baseline for a run that
  keeps the long documents whole.
"""

from __future__ import annotations

import heapq
from types import MappingProxyType

import numba
import numpy as np

from omniscale.balancer.assign import lpt, place_sp_groups
from omniscale.balancer.encoder_plan import plan_encoders
from omniscale.balancer.planner import window_split
from omniscale.balancer.split import largest_sp_size, unit_cost
from omniscale.balancer.stream import item_costs, llm_costs
from omniscale.balancer.types import PlannerConfig, StepPlan, WindowSamples, slice_tokens


def strided(samples: WindowSamples, costs, config: PlannerConfig) -> StepPlan:
    """DistributedSampler-like: round-robin ranks, consecutive samples fill micro-batches."""
    n = samples.num_samples
    rank_N = (np.arange(n) % config.dp).astype(np.int64)
    mb_N = _pack(samples.tokens_N, rank_N, _ones(n), np.arange(n), config.dp,
                 config.micro_batch_tokens, False)
    return assemble(samples, costs, config, rank_N, mb_N)


def first_fit(samples: WindowSamples, costs, config: PlannerConfig) -> StepPlan:
    """Dynamic batching: contiguous chunks per rank, first-fit under the token budget."""
    n = samples.num_samples
    rank_N = np.arange(n, dtype=np.int64) * config.dp // max(n, 1)
    mb_N = _pack(samples.tokens_N, rank_N, _ones(n), np.arange(n), config.dp,
                 config.micro_batch_tokens, True)
    return assemble(samples, costs, config, rank_N, mb_N)


def token_lpt(samples: WindowSamples, costs, config: PlannerConfig) -> StepPlan:
    """Longest first onto the rank with the fewest tokens; first-fit-decreasing packing."""
    order_N = np.argsort(-samples.tokens_N, kind="stable")
    rank_N = _lpt(samples.tokens_N.astype(np.float64), order_N, config.dp)
    mb_N = _pack(samples.tokens_N, rank_N, _ones(len(rank_N)), order_N, config.dp,
                 config.micro_batch_tokens, True)
    return assemble(samples, costs, config, rank_N, mb_N)


def kk_cost(samples: WindowSamples, costs, config: PlannerConfig) -> StepPlan:
    """Equal-size Karmarkar–Karp on the LLM cost (as verl balances its batches)."""
    rank_N = karmarkar_karp_equal(llm_costs(samples, costs), config.dp)
    order_N = np.argsort(-samples.tokens_N, kind="stable")
    mb_N = _pack(samples.tokens_N, rank_N, _ones(len(rank_N)), order_N, config.dp,
                 config.micro_batch_tokens, True)
    return assemble(samples, costs, config, rank_N, mb_N)


def _lower_bound(unit_N, k_N, dp: int, speed_R) -> float:
    """The step's bound in time, as the planner states it: the work spread by speed, and the
    costliest piece on the fastest rank (equal ranks: speed 1)."""
    if not len(unit_N):
        return 0.0
    pooled = dp if speed_R is None else float(np.sum(speed_R))
    fastest = 1.0 if speed_R is None else float(np.max(speed_R))
    return float(max((unit_N * k_N).sum() / pooled, unit_N.max() / fastest))


def split_sizes(samples: WindowSamples, costs, config: PlannerConfig,
                n_steps: int = 1) -> np.ndarray:
    """SP group size of every sample (int64, 1 = whole) as the planner decides it for
    ``n_steps`` steps of these samples on ``config.dp`` ranks (``planner.window_split``: the
    share rule or the budget rule, whichever plans the window's first step shorter), so every
    ``+split`` baseline runs our split."""
    return window_split(samples, costs, config, n_steps).astype(np.int64)


def _pieces(samples, costs, config, sp_size_N):
    """(k, tokens per rank, cost per rank) of every sample under the split."""
    k_N = split_sizes(samples, costs, config) if sp_size_N is None \
        else np.asarray(sp_size_N, np.int64)
    slice_N = np.asarray(slice_tokens(samples.tokens_N, k_N), np.int64)
    unit_N = unit_cost(llm_costs(samples, costs), samples.tokens_N, k_N,
                       costs.sp_comm_per_token)
    return k_N, slice_N, unit_N


def strided_split(samples: WindowSamples, costs, config: PlannerConfig,
                  sp_size_N=None) -> StepPlan:
    """Round-robin in arrival order; a split sample takes the next aligned group of k ranks."""
    k_N, slice_N, _ = _pieces(samples, costs, config, sp_size_N)
    first_N = _strided_groups(k_N, config.dp)
    n = samples.num_samples
    return _pack_groups(samples, costs, config, first_N, k_N, slice_N, np.arange(n), False)


def first_fit_split(samples: WindowSamples, costs, config: PlannerConfig,
                    sp_size_N=None) -> StepPlan:
    """Contiguous chunks; a split sample on the aligned group holding its chunk's rank."""
    k_N, slice_N, _ = _pieces(samples, costs, config, sp_size_N)
    n = samples.num_samples
    rank_N = np.arange(n, dtype=np.int64) * config.dp // max(n, 1)
    first_N = np.minimum(rank_N // k_N, config.dp // k_N - 1) * k_N  # groups fit in dp
    return _pack_groups(samples, costs, config, first_N, k_N, slice_N, np.arange(n), True)


def token_lpt_split(samples: WindowSamples, costs, config: PlannerConfig,
                    sp_size_N=None) -> StepPlan:
    """Groups (widest, then longest first) on the aligned group with the fewest tokens on its
    fullest rank, then whole samples by LPT on tokens; first-fit-decreasing packing."""
    k_N, slice_N, _ = _pieces(samples, costs, config, sp_size_N)
    first_N = _groups_then_lpt(slice_N.astype(np.float64), k_N, config.dp)
    order_N = _widest_heaviest_first(slice_N.astype(np.float64), k_N)
    return _pack_groups(samples, costs, config, first_N, k_N, slice_N, order_N, True)


def kk_cost_split(samples: WindowSamples, costs, config: PlannerConfig,
                  sp_size_N=None) -> StepPlan:
    """Groups (widest, then costliest first) on the aligned group whose costliest rank is
    cheapest; whole samples in dp equal-count Karmarkar–Karp parts, the costliest part onto
    the least loaded rank; first-fit-decreasing packing on tokens."""
    k_N, slice_N, unit_N = _pieces(samples, costs, config, sp_size_N)
    dp = config.dp
    split_N = k_N > 1
    load_R = np.zeros(dp, np.float64)
    first_N = place_sp_groups(unit_N, k_N, _widest_heaviest_first(unit_N, k_N)[
        :int(split_N.sum())], load_R)
    whole = np.flatnonzero(~split_N)
    part_W = karmarkar_karp_equal(unit_N[whole], dp)
    part_R = np.bincount(part_W, weights=unit_N[whole], minlength=dp)
    rank_of_part = np.empty(dp, np.int64)
    rank_of_part[np.argsort(-part_R, kind="stable")] = np.argsort(load_R, kind="stable")
    first_N[whole] = rank_of_part[part_W]
    order_N = _widest_heaviest_first(slice_N.astype(np.float64), k_N)
    return _pack_groups(samples, costs, config, first_N, k_N, slice_N, order_N, True)


def static_sp(samples: WindowSamples, costs, config: PlannerConfig,
              sp_size_N=None) -> StepPlan:
    """Every sample sharded over an aligned SP group of k = ``largest_sp_size(sp_max, dp)``
    ranks (the ``dp mod k`` ranks past the last group stay idle, as a job whose world is no
    multiple of its SP degree leaves them); samples to groups by LPT on tokens (longest
    first), first-fit-decreasing packing under the per-rank budget; items encoded by the
    planner's encoder plan. ``sp_size_N`` is ignored: a static layout takes no split
    decision (module docstring)."""
    n, dp = samples.num_samples, config.dp
    k = largest_sp_size(config.sp_max, dp)
    k_N = np.full(n, k, np.int64)
    slice_N = np.asarray(slice_tokens(samples.tokens_N, k_N), np.int64)
    order_N = np.argsort(-slice_N, kind="stable")
    first_N = _lpt(slice_N.astype(np.float64), order_N, dp // k) * k
    mb_N = _pack(slice_N, first_N, k_N, order_N, dp, config.micro_batch_tokens, True)
    plan = assemble(samples, costs, config, first_N, mb_N, k_N)
    enc = plan_encoders(item_costs(samples, costs), samples.item_tokens_M, plan.consume_rank_M,
                        dp, costs.reshard_per_token)
    plan.encode_rank_M, plan.encoder_cost_R = enc.encode_rank_M, enc.encoder_cost_R
    plan.reshard = enc.reshard
    return plan


BASELINES_NO_SPLIT = MappingProxyType({
    "strided": strided, "first_fit": first_fit, "token_lpt": token_lpt, "kk_cost": kk_cost})
SPLIT_SUFFIX = "+split"
BASELINES_SPLIT = MappingProxyType({
    "strided" + SPLIT_SUFFIX: strided_split, "first_fit" + SPLIT_SUFFIX: first_fit_split,
    "token_lpt" + SPLIT_SUFFIX: token_lpt_split, "kk_cost" + SPLIT_SUFFIX: kk_cost_split})
# static layouts: no split decision (module docstring); not in the per-step families above,
# which the simulator and the per-step best baseline compare under our split
STATIC_LAYOUTS = MappingProxyType({"static_sp": static_sp})
# every policy by the name plan_policy asks for: a static layout also under its "+split" name
BASELINES = MappingProxyType({**BASELINES_NO_SPLIT, **BASELINES_SPLIT, **STATIC_LAYOUTS,
                              **{name + SPLIT_SUFFIX: fn for name, fn in STATIC_LAYOUTS.items()}})


def may_split(name: str) -> bool:
    """Whether the named baseline applies the long-short split."""
    return name.endswith(SPLIT_SUFFIX)


def _pack_groups(samples, costs, config, first_N, k_N, slice_N, order_N, first) -> StepPlan:
    """Pack the placed pieces (`_pack`) and assemble the plan; every group must lie on aligned
    ranks inside dp (checked here: the numba packer does not check bounds)."""
    if len(k_N) and ((first_N < 0).any() or (first_N % k_N).any()
                     or (first_N + k_N > config.dp).any()):
        raise ValueError("baseline placed an SP group off its aligned ranks")
    mb_N = _pack(slice_N, first_N, k_N, order_N, config.dp, config.micro_batch_tokens, first)
    return assemble(samples, costs, config, first_N, mb_N, k_N)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, np.int64)


def _widest_heaviest_first(weight_N: np.ndarray, k_N: np.ndarray) -> np.ndarray:
    """Split samples first (widest group, then heaviest), then whole ones, heaviest first;
    ties by index."""
    return np.lexsort((np.arange(len(k_N)), -weight_N, -k_N))


def _groups_then_lpt(weight_N: np.ndarray, k_N: np.ndarray, dp: int) -> np.ndarray:
    """First rank of every sample: groups onto aligned groups, then whole samples by LPT, all
    on ``weight_N`` per rank."""
    order_N = _widest_heaviest_first(weight_N, k_N)
    n_split = int((k_N > 1).sum())
    load_R = np.zeros(dp, np.float64)
    first_N = place_sp_groups(weight_N, k_N, order_N[:n_split], load_R)
    rank_N = lpt(weight_N, order_N[n_split:], load_R)
    return np.where(k_N > 1, first_N, rank_N)


def _strided_groups(k_N: np.ndarray, dp: int) -> np.ndarray:
    """First rank of every sample, in arrival order: a cursor walks the ranks round-robin; a
    sample of k takes the aligned group at or after the cursor (wrapping to rank 0 when none
    is left before rank dp), and the cursor moves past it."""
    first_N = np.zeros(len(k_N), np.int64)
    cursor = 0
    for i, k in enumerate(k_N.tolist()):
        a = -(-cursor // k) * k
        a = 0 if a + k > dp else a
        first_N[i] = a
        cursor = (a + k) % dp
    return first_N


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
             mb_N: np.ndarray, sp_size_N: np.ndarray | None = None) -> StepPlan:
    """The StepPlan of samples at (rank, micro-batch), costs and bound filled in.

    ``sp_size_N`` (default all 1): a sample of k > 1 runs on ranks ``rank_N .. rank_N + k - 1``
    (slices 0..k-1, one slot), each carrying c/k plus its all-to-all cost. The lower bound is
    the planner's for these pieces: the mean rank cost, and the dearest piece (a whole sample
    or one slice). Encoder items are encoded where they are consumed, on the rank of slice 0
    (no reshard).
    """
    n, dp = samples.num_samples, config.dp
    k_N = np.ones(n, np.int64) if sp_size_N is None else np.asarray(sp_size_N, np.int64)
    unit_N = unit_cost(llm_costs(samples, costs), samples.tokens_N, k_N,
                       costs.sp_comm_per_token)
    slice_N = np.asarray(slice_tokens(samples.tokens_N, k_N), np.int64)
    group_P = np.repeat(np.arange(n, dtype=np.int64), k_N)
    index_P = np.arange(len(group_P)) - (np.cumsum(k_N) - k_N)[group_P]
    rank_P = rank_N[group_P] + index_P
    slot_P = mb_N[group_P]
    slots = int(mb_N.max()) + 1 if n else 0
    mb_cost_RB = np.zeros((dp, slots), np.float64)
    mb_tokens_RB = np.zeros((dp, slots), np.int64)
    np.add.at(mb_cost_RB, (rank_P, slot_P), unit_N[group_P])
    np.add.at(mb_tokens_RB, (rank_P, slot_P), slice_N[group_P])
    item_sample_M = np.repeat(np.arange(n, dtype=np.int64), np.diff(samples.item_offsets_N1))
    consume_rank_M = rank_N[item_sample_M].astype(np.int32)
    encoder_cost_R = np.bincount(consume_rank_M, weights=item_costs(samples, costs),
                                 minlength=dp).astype(np.float64)
    return StepPlan(
        step=0, sample_P=group_P, rank_P=rank_P.astype(np.int32),
        micro_batch_P=slot_P.astype(np.int32), sp_size_P=k_N[group_P].astype(np.int32),
        sp_index_P=index_P.astype(np.int32), num_micro_batches=slots, mb_cost_RB=mb_cost_RB,
        mb_tokens_RB=mb_tokens_RB,
        lower_bound=_lower_bound(unit_N, k_N, dp, config.speed_R),
        item_M=np.arange(samples.num_items, dtype=np.int64), item_sample_M=item_sample_M,
        encode_rank_M=consume_rank_M, consume_rank_M=consume_rank_M.copy(),
        encoder_cost_R=encoder_cost_R, reshard=False,
        displacement_P=np.zeros(len(group_P), np.int32),
        speed_R=config.speed_R)  # placed blind to the ranks' speeds, judged by them


@numba.njit(cache=True)
def _lpt(weight_N, order_N, ranks):
    """Rank of each sample when taken in ``order_N`` onto the least-loaded rank (lowest id;
    0 for a sample not in ``order_N``): ``assign.lpt``, O(N log R) where a scan of the ranks
    per sample was O(N·R)."""
    return np.maximum(lpt(weight_N, order_N, np.zeros(ranks, np.float64)), 0)


@numba.njit(cache=True)
def _pack(tokens_N, first_N, k_N, order_N, ranks, budget, first):
    """Micro-batch of each sample, taking the samples in ``order_N``; sample i holds
    ``tokens_N[i]`` tokens on each of the ranks ``first_N[i] .. first_N[i] + k_N[i] - 1``, all
    in one slot.

    ``first``: first fit (the lowest slot with room on all its ranks, else a new one);
    otherwise consecutive (the last slot opened on its ranks if it has room on all of them,
    else a new one). A new slot is one past the last opened on any of its ranks, so empty on
    all of them. A sample over the budget gets a slot of its own; nothing else joins it.
    """
    n = len(tokens_N)
    # Slots per rank: one per piece it holds is plenty to start (a grid of ranks × samples
    # was 1 GB at 4,096 ranks); a group's new slot may lie past that, so the grid widens.
    pieces_R = np.zeros(ranks, np.int64)
    for i in order_N:
        for r in range(first_N[i], first_N[i] + k_N[i]):
            pieces_R[r] += 1
    load_RB = np.zeros((ranks, max(1, pieces_R.max() + 1 if ranks else 1)), np.int64)
    used_R = np.zeros(ranks, np.int64)
    mb_N = np.zeros(n, np.int64)
    for i in order_N:
        a, k, t = first_N[i], k_N[i], tokens_N[i]
        top = 0
        for r in range(a, a + k):
            top = max(top, used_R[r])
        if top >= load_RB.shape[1]:
            wider = np.zeros((ranks, 2 * load_RB.shape[1]), np.int64)
            wider[:, :load_RB.shape[1]] = load_RB
            load_RB = wider
        slot = -1
        for b in range(top - 1 if not first and top else 0, top):
            fits = True
            for r in range(a, a + k):
                if load_RB[r, b] + t > budget:
                    fits = False
                    break
            if fits:
                slot = b
                break
        if slot < 0:
            slot = top
        for r in range(a, a + k):
            load_RB[r, slot] += t
            used_R[r] = max(used_R[r], slot + 1)
        mb_N[i] = slot
    return mb_N
