"""Encoder plan: which rank encodes each media item, and the reshard map to its consumer.

Encoder cost follows the media (a 4-minute video on one rank) rather than the LLM tokens, so
balancing the LLM leaves encoders unbalanced. Encoders run data-parallel over all ranks with
their own placement: items are spread by LPT on encoder cost, and an all-to-all moves each
item's embeddings (its LLM tokens) to the rank whose sequence holds its placeholders. The
consumer of an item of a split sample is the rank holding slice 0 of the group (the group's
first rank); the trainer's Ulysses layout spreads it from there like the text tokens.

Shape suffixes: M encoder items of the step, R ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from omniscale.balancer.assign import lpt, lpt_speeds


@dataclass(frozen=True)
class EncoderPlan:
    encode_rank_M: np.ndarray  # int32
    encoder_cost_R: np.ndarray  # float64: predicted encoder cost per rank under this plan
    reshard: bool  # False: every item is encoded where it is consumed
    saving: float  # predicted: max local encoder cost - max balanced encoder cost
    comm: float  # predicted: reshard_per_token × max over ranks of tokens sent or received


def plan_encoders(item_cost_M: np.ndarray, item_tokens_M: np.ndarray,
                  consume_rank_M: np.ndarray, dp: int,
                  reshard_per_token: float, speed_R: np.ndarray | None = None) -> EncoderPlan:
    """Balance items over ranks, and keep the result only when it pays.

    Resharding pays when the predicted saving on the slowest rank exceeds the predicted
    all-to-all time (bounded by the rank that sends or receives the most tokens); otherwise,
    and when there is nothing to save, every item is encoded by its consumer.
    Deterministic: items ordered by cost (ties by index), ties between ranks to the lowest.
    ``speed_R``: the ranks' relative speeds (None: equal); items then go where they finish
    first, and the saving is judged in time. ``encoder_cost_R`` stays in cost (work).
    """
    item_cost_M = np.ascontiguousarray(item_cost_M, np.float64)
    consume_rank_M = np.asarray(consume_rank_M, np.int32)
    m = len(item_cost_M)
    local_R = np.bincount(consume_rank_M, weights=item_cost_M, minlength=dp)
    if m == 0:
        return EncoderPlan(consume_rank_M.copy(), local_R, False, 0.0, 0.0)
    order_M = np.argsort(-item_cost_M, kind="stable")  # costliest first, ties by index
    balanced_R = np.zeros(dp, np.float64)
    if speed_R is None:
        encode_rank_M = lpt(item_cost_M, order_M, balanced_R).astype(np.int32)
        # LPT's bins are interchangeable; relabel them so the most items stay where they are
        # consumed (greedy on the largest overlaps), which cuts traffic at no cost to balance.
        encode_rank_M, balanced_R = _relabel(encode_rank_M, consume_rank_M, item_tokens_M,
                                             balanced_R, dp)
    else:  # bins of ranks of different speeds are not interchangeable: no relabelling
        inv_R = 1.0 / np.asarray(speed_R, np.float64)
        encode_rank_M = lpt_speeds(item_cost_M, order_M, balanced_R, inv_R).astype(np.int32)
        local_R = local_R * inv_R  # times, as balanced_R
    moved_M = encode_rank_M != consume_rank_M
    tokens_M = np.asarray(item_tokens_M, np.float64)
    sent_R = np.bincount(encode_rank_M[moved_M], weights=tokens_M[moved_M], minlength=dp)
    recv_R = np.bincount(consume_rank_M[moved_M], weights=tokens_M[moved_M], minlength=dp)
    comm = reshard_per_token * float(max(sent_R.max(), recv_R.max()))
    saving = float(local_R.max() - balanced_R.max())
    if speed_R is not None:  # back to work per rank
        local_R, balanced_R = local_R * speed_R, balanced_R * speed_R
    if saving > comm:
        return EncoderPlan(encode_rank_M, balanced_R, True, saving, comm)
    return EncoderPlan(consume_rank_M.copy(), local_R, False, saving, comm)


def _relabel(bin_M, consume_rank_M, item_tokens_M, load_R, dp):
    """Map LPT bins to ranks, largest (bin, rank) token overlap first."""
    pair_M = bin_M.astype(np.int64) * dp + consume_rank_M
    pairs, inverse = np.unique(pair_M, return_inverse=True)
    overlap = np.bincount(inverse, weights=np.asarray(item_tokens_M, np.float64) + 1.0)
    pairs = pairs[np.lexsort((pairs, -overlap))]
    rank_of_bin = _match(pairs, dp)
    relabeled_R = np.zeros(dp, np.float64)
    relabeled_R[rank_of_bin] = load_R
    return rank_of_bin[bin_M].astype(np.int32), relabeled_R


@njit(cache=True)
def _match(pairs, dp):
    rank_of_bin = np.full(dp, -1, np.int64)
    taken_R = np.zeros(dp, np.bool_)
    for p in pairs:
        b, r = p // dp, p % dp
        if rank_of_bin[b] < 0 and not taken_R[r]:
            rank_of_bin[b] = r
            taken_R[r] = True
    r = 0
    for b in range(dp):
        if rank_of_bin[b] < 0:
            while taken_R[r]:
                r += 1
            rank_of_bin[b] = r
            taken_R[r] = True
    return rank_of_bin
