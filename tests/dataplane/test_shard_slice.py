"""A shard's index rows as the plane hands them out: each row's ref, checked field by field
against values written out by hand from the rows (the defaults for nulls, truncation, several
members, the cursor's order), and the batch the mixer builds from those rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from omniscale.dataplane.shard_slice import ShardSlice
from omniscale.index_schema import INDEX_SCHEMA
from omniscale.refs import REF_SCHEMA, SampleRef

ROWS = [  # key, offset, size, members, text, image, video, audio, llm, error, target
    ("a", 0, 10, [{"name": "a.txt", "offset": 1, "size": 2}], 5, [], [], [], 5, None, 2),
    ("b", None, 11, None, None, None, None, None, None, None, None),
    ("c", 20, 12, [{"name": "c.jpg", "offset": 3, "size": 4},
                   {"name": "c.txt", "offset": 5, "size": 6}], 7, [16, 64], [], [], 30, None,
     None),
    ("d", 30, 13, [], 900, [], [], [], 900, None, 800),  # text only, over the cap: cut
    ("e", 40, 14, [], 10, [], [8], [100], 900, None, 3),  # media over the cap: skipped
    ("f", 50, 15, [], 1, [], [], [], 1, "bad header", 1),
]


def shard_table() -> pa.Table:
    names = ["key", "offset", "size", "members", "text_tokens", "image_patches",
             "video_patches", "audio_frames", "llm_tokens", "error", "target_tokens"]
    columns = {n: [row[i] for row in ROWS] for i, n in enumerate(names)}
    return pa.table({n: pa.array(v, INDEX_SCHEMA.field(n).type) for n, v in columns.items()})


def test_rows_become_refs_with_the_row_at_a_time_defaults():
    order = np.array([2, 0, 1, 3, 4, 5])  # the cursor visits row 2 first
    s = ShardSlice(3, 1, "sh-1.tar", order, shard_table(), max_tokens=500, source_id=7,
                   source="src")
    want = [
        SampleRef(7, "src", "sh-1.tar", "c", 20, 12, (("c.jpg", 3, 4), ("c.txt", 5, 6)), 30, 7,
                  (16, 64), (), (), 3, 7),  # no target count: its text tokens
        SampleRef(7, "src", "sh-1.tar", "a", 0, 10, (("a.txt", 1, 2),), 5, 5, (), (), (), 3,
                  2),
        SampleRef(7, "src", "sh-1.tar", "b", None, 11, (), 0, 0, (), (), (), 3, 0),
        SampleRef(7, "src", "sh-1.tar", "d", 30, 13, (), 500, 500, (), (), (), 3, 500),
    ]
    assert s.refs(np.arange(4)) == want
    assert s.refs(np.array([3, 0])) == [want[3], want[0]]  # not a run: taken row by row
    taken = s.take(np.arange(1, 3))
    assert taken.schema == REF_SCHEMA and taken.num_rows == 2
    s.classify({("sh-1.tar", "a"), ("other.tar", "c")}, version=1)
    assert s.ok_K.tolist() == [0, 2, 3]  # a quarantined, e too long with media, f corrupt
    assert s.skipped(0, 6) == (1, 1, 1)
