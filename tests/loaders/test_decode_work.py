"""What a rank decodes of each sample its plan names (``loaders.assemble.decode_work``), on a
hand-written plan table: the text where it trains the sample, the media it encodes, nothing
of the media another rank encodes."""

from __future__ import annotations

import pyarrow as pa

from omniscale.loaders.assemble import decode_work
from omniscale.loaders.decode import DecodeNeed
from omniscale.plan import PLAN_SCHEMA, decode_plan


def _row(key, role, images=(), videos=(), audio=(), encode_ranks=(), item=(None, None),
         consume_rank=None, micro_batch=0):
    return {"source_id": 0, "source": "s", "shard": "a.tar", "key": key, "offset": 0,
            "size": 1, "members": [], "llm_tokens": 10, "text_tokens": 4,
            "image_patches": list(images), "video_patches": list(videos),
            "audio_frames": list(audio), "epoch": 0, "role": role, "step": 0, "rank": 0,
            "micro_batch": micro_batch if role == "llm" else None, "sp_size": 1, "sp_index": 0,
            "sp_first_rank": 0, "encode_ranks": list(encode_ranks), "item_kind": item[0],
            "item_index": item[1], "consume_rank": consume_rank, "consume_span": 1}


def _table(rows):
    return decode_plan(pa.Table.from_pylist(rows, schema=PLAN_SCHEMA))


ROWS = [
    # trained here; image 0 encoded here, image 1 and the audio clip on rank 1
    _row("a", "llm", images=(16, 16), audio=(100,), encode_ranks=(0, 1, 1)),
    # encoded here for rank 1 only: the clip, neither the text nor the audio
    _row("b", "encode", videos=(32,), audio=(50,), item=("video", 0), consume_rank=1),
    _row("c", "llm"),  # text only
    _row("d", "llm", images=(16,), encode_ranks=()),  # no encoder plan: encoded here
    _row("e", "llm", videos=(32,), encode_ranks=(0,)),  # everything here
    # trained here and its audio encoded here too (an encode row for its own consumer)
    _row("f", "llm", images=(16,), audio=(100,), encode_ranks=(1, 0)),
    _row("f", "encode", images=(16,), audio=(100,), item=("audio", 0), consume_rank=0),
]


def test_each_sample_is_decoded_as_far_as_this_rank_uses_it():
    work = decode_work(_table(ROWS), rank=0)
    assert [(ref.key, need) for ref, need in work] == [
        ("a", DecodeNeed(True, frozenset({("image", 0)}))),
        ("b", DecodeNeed(False, frozenset({("video", 0)}))),
        ("c", None),
        ("d", None),
        ("e", None),
        ("f", DecodeNeed(True, frozenset({("audio", 0)}))),
    ]


def test_without_a_rank_every_sample_is_decoded_whole():
    work = decode_work(_table(ROWS))
    assert [ref.key for ref, _ in work] == ["a", "b", "c", "d", "e", "f"]
    assert all(need is None for _, need in work)
