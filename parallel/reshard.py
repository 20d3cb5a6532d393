"""Encoder→LLM reshard: one all-to-all moves every encoded media item's embeddings from the rank
that encoded it (the encoder plan) to the ranks whose sequences hold its placeholders.

The exchange is the data plane's reshard map, decoded with the rank's plan
(`omniscale.plan.RankPlan`): each LLM row lists, per encoder item of its sample (images, then
videos, then audio clips: `omniscale.plan.item_kinds`), the rank encoding it; each encode row,
the ranks consuming the item it encodes. Each rank derives its side of the exchange from its
own plan (`local_reshard_plan`, `RankPlan.reshard_plan`: what a step of training costs,
whatever the number of ranks): items are sent by e in (c, item) order and received by c in
(e, item) order, so the two sides agree without sending any identifiers. `reshard_plan`
derives the same from every rank's plan and checks that the producer and consumer sides agree
(tests, debugging). An item of a sample split over an SP group goes to every rank of the group
(each has an LLM row for its slice; `scatter_media` keeps the rows inside its slice) — the k
copies' gradients add up on the encoding rank in backward.

Row counts per item are not in the plan (they depend on the encoder's merge), so `reshard`
exchanges them first (a small integer all-to-all), then the embeddings through the autograd
`all_to_all_single`; backward returns each consumer's gradients to the encoder. Every rank
must add the returned `zero` term to its loss: a rank that consumes nothing still takes part
in the backward all-to-all (comm.py).

Shape suffixes: N embedding rows (all items), D LLM width, R ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from omniscale.kernels.transfer import to_device
from omniscale.parallel.comm import Group, all_to_all_single, group_size
from omniscale.plan import ItemKey, RankPlan, ReshardPlan


def reshard_plan(plans: list[RankPlan], rank: int) -> ReshardPlan:
    """The exchange of `rank` from every rank's plan of the step (`plans[r]` is rank r's, as
    `dataplane.plan_table.rank_tables` builds them or `get_plan(step, r)` serves them; tables
    are decoded here). Checks that the encode rows of `rank` are exactly the items the LLM
    rows expect from it, so a plan the two sides read differently fails here rather than in
    the collective."""
    world = len(plans)
    pairs: set[tuple[ItemKey, int, int]] = set()
    for c, plan in enumerate(plans):
        pairs.update((item, e, c) for item, e in plan.consumed_items())
    encoded = {item: first for item, first, _ in plans[rank].encoded_items()}
    send = sorted((c, item) for item, e, c in pairs if e == rank)
    expected, send_pairs = {item for _, item in send}, set(send)
    if expected != set(encoded) or any((encoded[i], i) not in send_pairs for i in encoded):
        missing = sorted(expected - set(encoded))
        extra = sorted(i for i in encoded if (encoded[i], i) not in send_pairs)
        raise ValueError(f"plan of rank {rank}: its encode rows disagree with the llm rows' "
                         f"encode_ranks (expected but not encoded: {missing[:3]}; encoded "
                         f"but unexpected or sent elsewhere: {extra[:3]})")
    recv = sorted((e, item) for item, e, c in pairs if c == rank)
    return ReshardPlan(
        send_items=[item for _, item in send],
        send_counts=[sum(1 for c, _ in send if c == r) for r in range(world)],
        recv_items=[item for _, item in recv],
        recv_counts=[sum(1 for e, _ in recv if e == r) for r in range(world)])


def local_reshard_plan(plan: RankPlan, rank: int, world: int) -> ReshardPlan:
    """`rank`'s side of the exchange from its own plan alone (`RankPlan.reshard_plan`; a table
    is decoded here). Equals `reshard_plan(every rank's plan, rank)`."""
    if plan.rank != rank:
        raise ValueError(f"reshard: the plan of rank {plan.rank} handed to rank {rank}")
    return plan.reshard_plan(world)


@dataclass
class Resharded:
    """The embeddings of the items this rank consumes, and the term every rank adds to its
    loss (0, tied to the exchange) so that the backward all-to-all runs everywhere."""

    items: dict[ItemKey, torch.Tensor]
    zero: torch.Tensor


def reshard(embeddings_by_item: Mapping[ItemKey, torch.Tensor], plan: ReshardPlan,
            group: Group = None, *, dim: int, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> Resharded:
    """Send each of `plan.send_items` (its `[num_tokens, dim]` block from `embeddings_by_item`)
    to its consumers and return the blocks of `plan.recv_items`. `dim`, `dtype` and `device`
    describe the blocks (given, since a rank may encode nothing). Differentiable: gradients of
    the returned blocks flow back to `embeddings_by_item` on the ranks that encoded them."""
    if len(plan.send_counts) != group_size(group):
        raise ValueError(f"reshard: the plan is for {len(plan.send_counts)} ranks, the group "
                         f"has {group_size(group)}")
    blocks = [embeddings_by_item[item].to(device, dtype) for item in plan.send_items]
    for item, block in zip(plan.send_items, blocks):
        if block.dim() != 2 or block.shape[1] != dim:
            raise ValueError(f"reshard: item {item} has shape {tuple(block.shape)}, "
                             f"expected [num_tokens, {dim}]")
    # Collectives take tensors on the step's device (NCCL refuses host tensors); reading the
    # received counts back is the exchange's one host sync (the embeddings' split sizes).
    sent = [b.shape[0] for b in blocks]
    rows_sent = to_device(sent, device, torch.int64)
    with torch.no_grad():
        rows_recv = all_to_all_single(rows_sent, plan.recv_counts, plan.send_counts, group)
    rows_recv = rows_recv.tolist()

    def per_rank(rows: list[int], counts: list[int]) -> list[int]:
        ends = list(itertools.accumulate(counts))
        return [sum(rows[end - n:end]) for end, n in zip(ends, counts)]

    send_ND = torch.cat(blocks) if blocks else torch.zeros(0, dim, dtype=dtype, device=device)
    if torch.is_grad_enabled() and not send_ND.requires_grad:
        # Every rank's exchange must be in its graph (an idle or frozen encoder's too), or its
        # backward all-to-all would not run here while the other ranks wait for it.
        send_ND = send_ND.detach().requires_grad_()
    recv_ND = all_to_all_single(send_ND, per_rank(rows_recv, plan.recv_counts),
                                per_rank(sent, plan.send_counts), group)
    items = dict(zip(plan.recv_items, recv_ND.split(rows_recv)))
    return Resharded(items, 0.0 * recv_ND.sum())
