"""Edges of the sample layout (``loaders.sequence``) on hand-checked examples: target flags and
the ``<eos>`` after them, caps next to media blocks, marker counts, labels without target
flags, and the layout's one-line refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from omniscale.layout import IGNORE_INDEX
from omniscale.loaders.decode_text import TextTokenizer
from omniscale.loaders.sequence import ItemSlot, LayoutError, build_sequence, shifted_labels

TOK = TextTokenizer(tokenizer=None, pad_id=0, eos_id=1,
                    marker_ids={"image": 2, "video": 3, "audio": 4})
X = IGNORE_INDEX


@pytest.mark.parametrize("targets, labels", [
    # ids 5 6 7 <eos>=1; label t is ids[t+1] when that token is a target; <eos> is a target
    # exactly when the last text token is
    ([False, True, True], [6, 7, 1, X]),
    ([True, True, False], [6, X, X, X]),
    ([False, False, True], [X, 7, 1, X]),
])
def test_eos_is_a_target_exactly_when_the_last_text_token_is(targets, labels):
    seq = build_sequence(np.array([5, 6, 7]), [], TOK, text_targets=np.array(targets))
    assert seq.input_ids_L.tolist() == [5, 6, 7, 1]
    assert seq.labels_L.tolist() == labels


def test_an_empty_text_with_target_flags_is_just_an_untrained_eos():
    seq = build_sequence(np.array([], np.int64), [], TOK, text_targets=np.array([], bool))
    assert seq.input_ids_L.tolist() == [1] and seq.labels_L.tolist() == [X]


@pytest.mark.parametrize("flags", [3, 1])
def test_target_flags_must_match_the_text_tokens_one_to_one(flags):
    with pytest.raises(LayoutError, match=f"{flags} target flags for 2 text tokens"):
        build_sequence(np.array([5, 6]), [], TOK, text_targets=np.ones(flags, bool))


def test_a_cap_after_a_media_block_keeps_the_block_and_cuts_the_text():
    # an unmarked image (1 token) first, then the text 5 6 7 8 and <eos>: 6 tokens; a cap of 3
    # keeps the image and "5 6", and a cap of 1 exactly the image
    items = [ItemSlot("image", 1, (1, 1, 1))]
    capped = build_sequence(np.array([5, 6, 7, 8]), items, TOK, max_tokens=3)
    assert capped.input_ids_L.tolist() == [2, 5, 6]
    assert capped.labels_L.tolist() == [X, 6, X]
    assert capped.token_starts == [0] and capped.full_length == 6
    assert build_sequence(np.array([5, 6, 7, 8]), items, TOK,
                          max_tokens=1).input_ids_L.tolist() == [2]


def test_a_cap_at_or_past_the_full_length_changes_nothing():
    items = [ItemSlot("audio", 2)]
    full = build_sequence(np.array([4, 5]), items, TOK)
    assert full.input_ids_L.tolist() == [4, 4, 5, 1]
    for cap in (4, 9):
        capped = build_sequence(np.array([4, 5]), items, TOK, max_tokens=cap)
        assert capped.input_ids_L.tolist() == [4, 4, 5, 1]
        assert capped.labels_L.tolist() == full.labels_L.tolist() == [X, X, 1, X]


def test_fewer_markers_than_items_of_their_kind_is_refused():
    items = [ItemSlot("image", 1, (1, 1, 1)), ItemSlot("image", 1, (1, 1, 1))]
    with pytest.raises(LayoutError, match=r"text has 1 image marker\(s\) but the sample has "
                                          r"2 image item\(s\)"):
        build_sequence(np.array([2, 5]), items, TOK)


def test_a_grid_that_does_not_fit_its_block_says_how_many_tokens_it_has():
    # a 2 x 3 x 2 grid is 12 tokens, not the block's 5
    with pytest.raises(LayoutError, match=r"^image grid \(2, 3, 2\) has 12 tokens, not 5$"):
        build_sequence(np.array([5]), [ItemSlot("image", 5, (2, 3, 2))], TOK)


def test_labels_without_target_flags_skip_media_and_the_end():
    # ids 5 6 <image> <image> 7 8: label t is ids[t+1] unless t or t+1 is media; the last has
    # none
    ids = np.array([5, 6, 2, 2, 7, 8])
    media = np.array([False, False, True, True, False, False])
    assert shifted_labels(ids, media).tolist() == [6, X, X, X, 8, X]
    targets = np.array([True, True, False, False, False, True])
    assert shifted_labels(ids, media, targets).tolist() == [6, X, X, X, 8, X]
    assert shifted_labels(ids, media, ~targets).tolist() == [X, X, X, X, X, X]


def test_layout_values_are_immutable():
    """Item slots are values (equal ones hash alike); a laid-out sequence is not changed by
    whoever reads it."""
    slot = ItemSlot("image", 4, (1, 2, 2))
    assert {slot: "a"}[ItemSlot("image", 4, (1, 2, 2))] == "a"
    with pytest.raises(dataclasses.FrozenInstanceError):
        slot.num_tokens = 5
    seq = build_sequence(np.array([5]), [], TOK)
    with pytest.raises(dataclasses.FrozenInstanceError):
        seq.full_length = 0
