"""Encoder→LLM reshard on real gloo processes, from plan tables the data plane builds
(`dataplane.plan_table.rank_tables`): forward then backward equal a single-process run that
encodes every item where it is consumed — with uneven item sizes, a rank that encodes nothing,
a rank that consumes nothing, and (4 ranks) an SP-split sample whose items reach both slices.
Who sends and receives what is checked against an oracle built from the cases' own rows (an
item goes from its encode rank to every rank whose sequence holds its sample), never against
the planner: each rank's side derived from its own table, and from every rank's table, equal
it."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from tests.parallel.multiproc import run_ranks

D = 4
# world -> (samples: (images, videos, audios) per sample; LLM placement rows: (sample, rank,
# sp_size, sp_index); encode rank of each item in sample/item order)
CASES = {
    2: ([(2, 0, 1), (0, 1, 0), (0, 0, 0)], [(0, 0, 1, 0), (1, 0, 1, 0), (2, 1, 1, 0)],
        [1, 1, 1, 1]),  # rank 0 encodes nothing, rank 1 consumes nothing
    4: ([(1, 0, 1), (2, 0, 0), (0, 1, 0), (0, 0, 0)],
        [(0, 0, 2, 0), (0, 1, 2, 1), (1, 2, 1, 0), (2, 0, 1, 0), (3, 3, 1, 0)],
        [3, 1, 3, 0, 0]),  # rank 2 encodes nothing, rank 3 consumes nothing
}


def _tables(world):
    from omniscale.balancer.types import StepPlan
    from omniscale.dataplane.plan_table import rank_tables
    from omniscale.plan import decode_plan
    from omniscale.refs import SampleRef

    samples, rows, encode = CASES[world]
    refs = [SampleRef(0, "src", "shard", f"k{i}", 0, 1, image_patches=(4,) * im,
                      video_patches=(8,) * vi, audio_frames=(16,) * au)
            for i, (im, vi, au) in enumerate(samples)]
    count_N = np.array([sum(s) for s in samples])
    first_N = np.cumsum(count_N) - count_N
    first_rank = {s: r for s, r, _, j in rows if j == 0}
    item_sample = np.repeat(np.arange(len(samples)), count_N)
    sample_P, rank_P, size_P, index_P = (np.array(c) for c in zip(*rows))
    plan = StepPlan(
        step=0, sample_P=sample_P, rank_P=rank_P.astype(np.int32),
        micro_batch_P=np.zeros(len(rows), np.int32), sp_size_P=size_P.astype(np.int32),
        sp_index_P=index_P.astype(np.int32), num_micro_batches=1,
        mb_cost_RB=np.zeros((world, 1)), mb_tokens_RB=np.zeros((world, 1), np.int64),
        lower_bound=0.0, item_M=np.arange(int(count_N.sum())), item_sample_M=item_sample,
        encode_rank_M=np.array(encode, np.int32),
        consume_rank_M=np.array([first_rank[s] for s in item_sample], np.int32), reshard=True)
    return [decode_plan(t) for t in rank_tables(plan, refs, first_N, step=0, dp=world)]


def _oracle(world):
    """Each rank's side of the exchange, from CASES alone: sample s's items (images, videos,
    audio clips) are sent by their encode rank to every rank holding a placement row of s,
    sent in (consumer, item) order and received in (encoder, item) order (reshard.py's
    contract, so both sides agree without identifiers)."""
    from omniscale.plan import ReshardPlan

    samples, rows, encode = CASES[world]
    items = [("src", "shard", f"k{s}", kind, i) for s, counts in enumerate(samples)
             for kind, n in enumerate(counts) for i in range(n)]
    assert len(items) == len(encode)
    consumers = {s: sorted({r for s_, r, _, _ in rows if s_ == s}) for s in range(len(samples))}
    pairs = [(e, c, item) for item, e in zip(items, encode)
             for c in consumers[int(item[2][1:])]]  # (encoder, consumer, item)
    plans = []
    for rank in range(world):
        send = sorted((c, item) for e, c, item in pairs if e == rank)
        recv = sorted((e, item) for e, c, item in pairs if c == rank)
        plans.append(ReshardPlan(
            send_items=[item for _, item in send],
            send_counts=[sum(c == r for c, _ in send) for r in range(world)],
            recv_items=[item for _, item in recv],
            recv_counts=[sum(e == r for e, _ in recv) for r in range(world)]))
    return plans


def _seed(item, extra=0):
    return zlib.crc32(repr(item).encode()) + extra


def _input(item):
    rows = 1 + _seed(item) % 4  # uneven item sizes
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(_seed(item)),
                       dtype=torch.float64)


def _weight(item, rank, rows):
    g = torch.Generator().manual_seed(_seed(item, 1000 * (rank + 1)))
    return torch.randn(rows, D, generator=g, dtype=torch.float64)


def _encoder():
    return torch.randn(D, D, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64).requires_grad_()


def _rank(rank, world):
    from omniscale.parallel.reshard import local_reshard_plan, reshard

    plan = local_reshard_plan(_tables(world)[rank], rank, world)  # what the trainer derives
    W = _encoder()
    inputs = {item: _input(item).requires_grad_() for item in plan.send_items}
    embeddings = {item: torch.tanh(x @ W) for item, x in inputs.items()}
    out = reshard(embeddings, plan, dim=D, dtype=torch.float64)
    loss = out.zero
    for item in plan.recv_items:
        block = out.items[item]
        loss = loss + (block * _weight(item, rank, block.shape[0])).sum()
    loss.backward()
    W_grad = W.grad if W.grad is not None else torch.zeros(D, D, dtype=torch.float64)
    return ({i: t.detach().numpy() for i, t in out.items.items()},
            {i: x.grad.numpy() for i, x in inputs.items()}, W_grad.numpy(), plan)


def _reference(world):
    """Every item encoded on each rank that consumes it (per the oracle), in one process."""
    W = _encoder()
    inputs, outs, loss = {}, [], 0.0
    for rank, side in enumerate(_oracle(world)):
        mine = {}
        for item in side.recv_items:
            x = inputs.setdefault(item, _input(item).requires_grad_())
            mine[item] = torch.tanh(x @ W)
            loss = loss + (mine[item] * _weight(item, rank, x.shape[0])).sum()
        outs.append(mine)
    loss.backward()
    return outs, {i: x.grad for i, x in inputs.items()}, W.grad


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_forward_and_backward_are_exact(world):
    results = run_ranks(_rank, world)
    want_out, want_grad, want_W = _reference(world)
    plans = [plan for *_, plan in results]
    assert plans == _oracle(world)
    if world == 2:
        assert plans[0].send_items == [] and plans[1].recv_items == []
    else:
        assert plans[2].send_items == [] and plans[3].recv_items == []
        split = {i for i in plans[0].recv_items if i[2] == "k0"}
        assert len(split) == 2 and split <= set(plans[1].recv_items)  # both SP slices
    for rank, (out, grads, _, _) in enumerate(results):
        assert out.keys() == want_out[rank].keys()
        for item, block in out.items():
            assert torch.equal(torch.from_numpy(block), want_out[rank][item].detach())
        for item, grad in grads.items():
            torch.testing.assert_close(torch.from_numpy(grad), want_grad[item],
                                       rtol=1e-12, atol=1e-12)
    sent = [i for g in (r[1] for r in results) for i in g]
    assert sorted(sent) == sorted(want_grad)  # every consumed item encoded exactly once
    torch.testing.assert_close(sum(torch.from_numpy(r[2]) for r in results), want_W)


def test_plan_rejects_encode_rows_that_disagree():
    from omniscale.parallel.reshard import reshard_plan

    tables = _tables(2)
    with pytest.raises(ValueError, match="plan of rank 0: its encode rows disagree"):
        reshard_plan([tables[1], tables[0]], 0)  # rank 0 reading rank 1's encode rows


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_derives_its_side_from_its_own_table(world):
    from omniscale.parallel.reshard import local_reshard_plan, reshard_plan

    tables, want = _tables(world), _oracle(world)
    for rank in range(world):
        assert local_reshard_plan(tables[rank], rank, world) == want[rank]
        assert reshard_plan(tables, rank) == want[rank]
    with pytest.raises(ValueError, match="outside the 1 ranks"):
        local_reshard_plan(tables[0], 0, 1)  # a table planned for more ranks than the group
