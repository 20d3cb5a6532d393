"""Which rank scores the held-out set under pipeline x tensor parallelism (issue #46, item 6):
``HeldOut._stages`` runs the slice through the stages' schedule on every rank, every
tensor-parallel peer of the last stage sees the hidden states (the head's logits are gathered
over the vocabulary by all of them), and only tensor-parallel rank 0 of the last stage counts
them -- so the counts summed over the world (``sum_group`` is the world under PP) hold each
micro-batch once, not once per TP peer.

A unit test over the four roles of a pp 2 x tp 2 data rank: the schedule is a stand-in that
hands each micro-batch's final hidden states to the score callback on the last stage (as
``PipelineRunner.evaluate`` does), so no 4-process run is needed; the counts are worked out by
hand."""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from omniscale.layout import IGNORE_INDEX
from omniscale.tools.train.held_out import HeldOut

X = IGNORE_INDEX
# two micro-batches of 3 tokens; "hidden states" that are their own logits over 4 tokens
HIDDEN = [torch.tensor([[5.0, 0, 0, 0], [0, 5, 0, 0], [0, 0, 0, 5]]),
          torch.tensor([[0.0, 0, 5, 0], [5, 0, 0, 0], [0, 5, 0, 0]])]
LABELS = [torch.tensor([0, 2, 3]), torch.tensor([2, X, 3])]
# predicted 0, 1, 3 | 2, (ignored), 1: right 0, 3, 2 -> 3 of 5 scored targets
ONE_COPY = (3, 5, Counter({2: 2, 3: 2, 0: 1}))


@dataclasses.dataclass
class _MicroBatch:
    """What the scoring reads of a micro-batch (the final hidden states stand in for the
    stages' forward), plus the fields ``step.placeholder`` replaces when it pads a run."""

    hidden_TD: torch.Tensor
    labels_T: torch.Tensor
    num_tokens: int = 3
    input_ids_T: object = None
    position_ids_T: object = None
    mrope_3T: object = None
    cu_seqlens_S1: object = None
    max_seqlen: int = 0
    seq_len_full_S: object = None
    seq_sp_size_S: object = None
    seq_sp_index_S: object = None
    seq_refs: object = None


class _Schedule:
    """A stage of the pipeline, as far as evaluation goes: every stage runs the forward;
    the last one calls ``score`` with each micro-batch's final hidden states and labels."""

    n_microbatches = 2

    def __init__(self, is_last: bool) -> None:
        self.is_last = is_last
        self.module = SimpleNamespace(logits=lambda hidden_TD: hidden_TD)

    def evaluate(self, run, score) -> None:
        for mb in run:
            if self.is_last:
                score(mb.hidden_TD, mb.labels_T)


def _counts(is_last: bool, tp_rank: int) -> tuple:
    held = HeldOut.__new__(HeldOut)  # the scoring alone: no held-out set to read
    held.ctx = SimpleNamespace(pipeline=_Schedule(is_last), tp_rank=tp_rank)
    mbs = [_MicroBatch(h, y) for h, y in zip(HIDDEN, LABELS)]
    return held._stages(mbs)


@pytest.mark.parametrize("is_last, tp_rank, want", [
    (True, 0, ONE_COPY),
    (True, 1, (0, 0, Counter())),  # a TP peer: sees the same logits, adds nothing
    (False, 0, (0, 0, Counter())),
    (False, 1, (0, 0, Counter())),
])
def test_only_the_last_stages_tp_rank_0_counts(is_last, tp_rank, want):
    assert _counts(is_last, tp_rank) == want


def test_the_worlds_sum_counts_each_micro_batch_once():
    roles = [(last, tp) for last in (False, True) for tp in (0, 1)]
    parts = [_counts(*role) for role in roles]
    total = (sum(p[0] for p in parts), sum(p[1] for p in parts),
             sum((p[2] for p in parts), Counter()))
    assert total == ONE_COPY
