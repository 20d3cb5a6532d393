"""The assembler's small pieces, one at a time (``loaders.assemble``): a step's sample and token
counts, what a fresh step reports before anything is measured, the reason a skip is counted by,
and which of a step's tensors are pinned for the copy to the GPU. Each was a survivor of the
mutation run (issue #46)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from omniscale.loaders.assemble import DecodedStep, StepBatch, _pin, reason_kind


def _micro_batch(cu_seqlens: list[int]) -> SimpleNamespace:
    """What the counts read of a PackedBatch: its sequence boundaries and tokens."""
    return SimpleNamespace(cu_seqlens_S1=torch.tensor(cu_seqlens, dtype=torch.int32),
                           num_tokens=cu_seqlens[-1])


def _step(micro_batches=(), encode_items=()) -> StepBatch:
    return StepBatch(step=3, micro_batches=list(micro_batches), encode_items=list(encode_items),
                     metadata={}, plan_fp="fp")


def test_a_steps_samples_and_tokens_are_summed_over_its_micro_batches():
    step = _step([_micro_batch([0, 3, 5]), _micro_batch([0, 4]), _micro_batch([0])])
    assert (step.num_samples, step.num_tokens) == (3, 9)
    assert (_step().num_samples, _step().num_tokens) == (0, 0)


def test_a_fresh_step_has_waited_for_nothing_and_moved_no_bytes():
    step = _step()
    assert (step.data_wait_s, step.transfer_bytes, step.io) == (0.0, 0, {})
    decoded = DecodedStep(samples={})
    assert decoded.transfer_bytes == 0
    decoded.update(DecodedStep(samples={}, transfer_bytes=7))
    assert decoded.transfer_bytes == 7


def test_a_skip_is_counted_by_its_reason_without_the_member_name():
    assert reason_kind("member a/b.jpg: cannot identify image file") == \
        "cannot identify image file"
    assert reason_kind("member c.wav: bad header: no RIFF") == "no RIFF"
    assert reason_kind("member d.jpg") == "member d.jpg"  # nothing after a name
    assert reason_kind("tar header: bad checksum") == "tar header: bad checksum"


def test_every_tensor_of_a_step_is_pinned_and_nothing_else(monkeypatch):
    """pin_memory needs CUDA: here it stands in by a copy that remembers it was made, so the
    test sees which tensors the assembler hands to it."""
    pinned = set()

    def pin_memory(self):
        copy = self.clone()
        pinned.add(id(copy))
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    micro = [SimpleNamespace(input_ids_T=torch.arange(4), labels_T=torch.arange(4),
                             max_seqlen=4) for _ in range(2)]
    items = [SimpleNamespace(tensor=torch.zeros(2, 3)) for _ in range(3)]
    _pin(_step(micro, items))
    for mb in micro:
        assert id(mb.input_ids_T) in pinned and id(mb.labels_T) in pinned
        assert mb.max_seqlen == 4
    assert all(id(item.tensor) in pinned for item in items)
    assert len(pinned) == 2 * 2 + 3
