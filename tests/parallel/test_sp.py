"""Ulysses SP with the long-short split on real gloo processes: long samples sliced over
aligned SP groups (collate's slices, global RoPE positions) give the same summed loss and
gradients as the unsplit micro-batch on one process, the short samples packed beside them
included, with equal slices or slices sized by the ranks' speeds (uneven all-to-alls), and
with query heads sized by speed too; a
micro-batch of whole sequences issues no collective."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.multiproc import run_ranks

# name -> length; the long ones are split. Per layout: each rank's micro-batches, as
# (sample, sp_size[, slice lengths]) in batch order (split samples in the same order on every
# rank; each split sample in one group once: the unsplit run counts it once); the layout's
# world is its number of ranks.
LENGTHS = {"A": 22, "B": 9, "C": 11, "L": 13, "M": 10, "a": 5, "b": 4, "c": 3, "d": 6,
           "e": 2}
PLANS = {
    2: [[[("a", 1), ("L", 2)], [("d", 1)]],
        [[("L", 2), ("b", 1), ("c", 1)], [("e", 1), ("c", 1)]]],
    # k=4 (kv heads replicated: 2 kv heads over 4 ranks) and two k=2 groups in one batch
    4: [[[("A", 4), ("B", 2), ("a", 1)]], [[("A", 4), ("B", 2)]],
        [[("A", 4), ("C", 2)]], [[("b", 1), ("A", 4), ("C", 2), ("c", 1)]]],
    # slices sized by speed: a slow rank 1 (and 3) holds fewer tokens, one slice a single token
    "2-by-speed": [[[("a", 1), ("L", 2, (10, 3))], [("d", 1), ("A", 2, (21, 1))]],
                   [[("L", 2, (10, 3)), ("b", 1), ("c", 1)], [("A", 2, (21, 1)), ("e", 1)]]],
    "4-by-speed": [[[("A", 4, (9, 6, 4, 3)), ("B", 2, (6, 3)), ("a", 1)]],
                   [[("A", 4, (9, 6, 4, 3)), ("B", 2, (6, 3))]],
                   [[("A", 4, (9, 6, 4, 3)), ("C", 2, (2, 9))]],
                   [[("b", 1), ("A", 4, (9, 6, 4, 3)), ("C", 2, (2, 9)), ("c", 1)]]],
    # two and three split sequences of one group in one micro-batch: exchanged together,
    # equal slices and slices sized by speed, whole samples between them
    "2-many": [[[("L", 2), ("a", 1), ("A", 2)], [("B", 2), ("C", 2), ("d", 1), ("M", 2)]],
               [[("L", 2), ("A", 2), ("b", 1)], [("B", 2), ("e", 1), ("C", 2), ("M", 2)]]],
    "2-many-by-speed": [[[("L", 2, (10, 3)), ("a", 1), ("A", 2, (21, 1))]],
                        [[("L", 2, (10, 3)), ("A", 2, (21, 1)), ("b", 1)]]],
    # a k=4 sequence and two k=2 ones on each pair, beside heads sized by speed on one pair
    "4-many": [[[("A", 4), ("B", 2), ("L", 2), ("a", 1)]], [[("A", 4), ("B", 2), ("L", 2)]],
               [[("A", 4), ("C", 2, None, (3, 1)), ("c", 1), ("M", 2)]],
               [[("b", 1), ("A", 4), ("C", 2, None, (3, 1)), ("M", 2)]]],
    # heads sized by speed too (4 query heads, 2 kv heads): 3 and 1, 1 and 3, and over four
    # ranks 1 each beside a pair's 2 and 2 (kv heads repeated however the heads fall)
    "2-heads": [[[("a", 1), ("L", 2, (10, 3), (3, 1))], [("d", 1), ("A", 2, (21, 1), (1, 3))]],
                [[("L", 2, (10, 3), (3, 1)), ("b", 1), ("c", 1)],
                 [("A", 2, (21, 1), (1, 3)), ("e", 1)]]],
    "4-heads": [[[("A", 4, (9, 6, 4, 3), (1, 1, 1, 1)), ("B", 2, (6, 3), (3, 1)), ("a", 1)]],
                [[("A", 4, (9, 6, 4, 3), (1, 1, 1, 1)), ("B", 2, (6, 3), (3, 1))]],
                [[("A", 4, (9, 6, 4, 3), (1, 1, 1, 1)), ("C", 2, None, (2, 2))]],
                [[("b", 1), ("A", 4, (9, 6, 4, 3), (1, 1, 1, 1)), ("C", 2, None, (2, 2)),
                  ("c", 1)]]],
}


def _model():
    from omniscale.backbone.config import ModelConfig, MoEConfig
    from omniscale.backbone.decoder import MoEDecoder

    config = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, ffn_dim=24, n_dense_layers=1,
                         moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8))
    torch.manual_seed(5)
    return MoEDecoder(config).double()


def _sample(name):
    from omniscale.layout import IGNORE_INDEX
    from omniscale.loaders.sequence import DecodedSample

    n = LENGTHS[name]
    g = torch.Generator().manual_seed(ord(name))
    ids = torch.randint(1, 40, (n,), generator=g)
    labels = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
    pos = torch.arange(n)
    return DecodedSample("s", name, ids, labels, pos, pos.expand(3, n).clone(), pad_id=0)


def _run(model, batch):
    out, _ = model(model.embed_tokens(batch.input_ids_T), batch.position_ids_T,
                   batch.cu_seqlens_S1, batch.max_seqlen)
    return model.loss(out, batch.labels_T)[0]


def _split_ranks(rank, world, layout):
    from torch.distributed.device_mesh import init_device_mesh

    import omniscale.parallel.sequence as sequence
    from omniscale.loaders.collate import collate
    from omniscale.parallel.sequence import apply_sp, sp_batch

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    model = apply_sp(_model(), mesh)
    total, calls = 0.0, []
    for micro in PLANS[layout][rank]:
        batch = collate([(_sample(n), k, rank % k, *slices) for n, k, *slices in micro])
        exchange = sequence.all_to_all_single
        counted = []

        def counting(*args, **kwargs):
            counted.append(1)
            return exchange(*args, **kwargs)
        # whole sequences only: no collective at all
        sequence.all_to_all_single = counting if any(k > 1 for _, k, *_ in micro) else None
        try:
            with sp_batch(model, batch):
                loss = _run(model, batch)
            loss.backward()
        finally:
            sequence.all_to_all_single = exchange
        total += loss.item()
        calls.append(len(counted))
    return total, calls, {n: p.grad.numpy() for n, p in model.named_parameters()
                          if p.grad is not None}


def _exchanges(micro) -> int:
    """The exchanges a micro-batch's forward makes per layer: one for each SP group's
    sequences with H/k heads each (one group per size k on a rank), one for each sequence
    with heads sized by speed."""
    even = {k for _, k, *rest in micro if k > 1 and (len(rest) < 2 or rest[1] is None)}
    by_heads = [k for _, k, *rest in micro if k > 1 and len(rest) == 2 and rest[1] is not None]
    return len(even) + len(by_heads)


def _whole(layout):
    from omniscale.loaders.collate import collate

    names = sorted({n for rank in PLANS[layout] for micro in rank for n, *_ in micro})
    model = _model()
    total = 0.0
    # the unsplit run: every sample once, each sample's loss counted once per occurrence
    for rank in PLANS[layout]:
        for micro in rank:
            for n, k, *_ in micro:
                if k == 1:
                    loss = _run(model, collate([(_sample(n), 1, 0)]))
                    loss.backward()
                    total += loss.item()
    longs = [n for n in names if any(k > 1 for r in PLANS[layout] for m in r for x, k, *_ in m
                                     if x == n)]
    loss = _run(model, collate([(_sample(n), 1, 0) for n in longs]))
    loss.backward()
    total += loss.item()
    return total, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", [2, 4, "2-by-speed", "4-by-speed", "2-heads", "4-heads",
                                    "2-many", "2-many-by-speed", "4-many"])
def test_split_long_samples_match_the_unsplit_run(layout):
    want_loss, want_grads = _whole(layout)
    results = run_ranks(_split_ranks, len(PLANS[layout]), layout)
    assert sum(loss for loss, _, _ in results) == pytest.approx(want_loss, rel=1e-6)  # fp32 router
    # one all-to-all there and one back per layer and exchange: a group's split sequences go
    # together, however many
    layers = _model().config.n_layers
    for (_, calls, _), micros in zip(results, PLANS[layout]):
        assert calls == [2 * layers * _exchanges(micro) for micro in micros]
    for name, want in want_grads.items():
        got = sum(torch.from_numpy(grads[name]) for _, _, grads in results if name in grads)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
