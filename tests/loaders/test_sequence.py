"""The LLM sequence of a sample on hand-checked examples: placeholder expansion, pre-shifted
labels and Qwen2-VL multimodal RoPE positions."""

from __future__ import annotations

import numpy as np
import pytest

from omniscale.layout import IGNORE_INDEX
from omniscale.loaders.decode_text import TextTokenizer
from omniscale.loaders.sequence import ItemSlot, LayoutError, build_sequence

TOK = TextTokenizer(tokenizer=None, pad_id=0, eos_id=1,
                    marker_ids={"image": 2, "video": 3, "audio": 4})
X = IGNORE_INDEX


def test_marked_image_and_unmarked_audio():
    # "a <image> b c" with one image (LLM grid 1x2x3 = 6 tokens) and an unmarked audio clip.
    items = [ItemSlot("image", 6, (1, 2, 3)), ItemSlot("audio", 2)]
    seq = build_sequence(np.array([10, 2, 11, 12]), items, TOK)
    assert seq.input_ids_L.tolist() == [4, 4, 10, 2, 2, 2, 2, 2, 2, 11, 12, 1]
    assert seq.labels_L.tolist() == [X, X, X, X, X, X, X, X, X, 12, 1, X]
    assert seq.position_ids_L.tolist() == list(range(12))
    assert seq.mrope_3L.tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]]
    assert seq.token_starts == [3, 0] and seq.full_length == 12


def test_caption_media_come_first_in_item_order_and_video_advances_in_time():
    # Unmarked video (grid 2x1x2 = 4 tokens) and image (1x1x1), then the caption "7 8".
    items = [ItemSlot("image", 1, (1, 1, 1)), ItemSlot("video", 4, (2, 1, 2))]
    seq = build_sequence(np.array([7, 8]), items, TOK)
    assert seq.input_ids_L.tolist() == [2, 3, 3, 3, 3, 7, 8, 1]
    assert seq.labels_L.tolist() == [X, X, X, X, X, 8, 1, X]
    assert seq.mrope_3L.tolist() == [
        [0, 1, 1, 2, 2, 3, 4, 5],
        [0, 1, 1, 1, 1, 3, 4, 5],
        [0, 1, 2, 1, 2, 3, 4, 5]]
    assert seq.token_starts == [0, 1]


def test_text_only_sample_and_its_cap():
    seq = build_sequence(np.array([5, 6, 7, 8]), [], TOK)
    assert seq.input_ids_L.tolist() == [5, 6, 7, 8, 1]
    assert seq.labels_L.tolist() == [6, 7, 8, 1, X]
    assert (seq.mrope_3L == np.arange(5)).all()
    capped = build_sequence(np.array([5, 6, 7, 8]), [], TOK, max_tokens=3)
    assert capped.input_ids_L.tolist() == [5, 6, 7] and capped.labels_L.tolist() == [6, 7, X]
    assert capped.full_length == 5


def test_a_cap_never_cuts_media_and_markers_must_match_items():
    items = [ItemSlot("image", 4, (1, 2, 2))]
    with pytest.raises(LayoutError, match="cut a media block"):
        build_sequence(np.array([5, 6]), items, TOK, max_tokens=3)
    with pytest.raises(LayoutError, match="2 image marker"):
        build_sequence(np.array([2, 5, 2]), items, TOK)
    with pytest.raises(LayoutError, match="1 video marker"):
        build_sequence(np.array([3]), items, TOK)
    with pytest.raises(LayoutError, match="grid"):
        build_sequence(np.array([5]), [ItemSlot("image", 5, (1, 2, 2))], TOK)
