"""SampleRefs cross the wire as Arrow tables: the round trip is exact."""

from __future__ import annotations

import pyarrow as pa
import pytest

from omniscale.refs import REF_SCHEMA, SampleRef, refs_to_table, table_to_refs


def test_refs_round_trip_through_arrow_ipc():
    refs = [SampleRef(3, "video", "v-000001.tar", "k7", 1024, 4096,
                      (("k7.txt", 1536, 20), ("k7.mp4", 2048, 2000)), llm_tokens=900,
                      text_tokens=12, image_patches=(), video_patches=(256, 128),
                      audio_frames=(), epoch=2),
            SampleRef(0, "docs", "d-0.parquet", "row-9", 0, 9, llm_tokens=40, text_tokens=40)]
    table = refs_to_table(refs)
    assert table.schema == REF_SCHEMA and table.num_rows == 2
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    back = pa.ipc.open_stream(sink.getvalue()).read_all()
    assert table_to_refs(back) == refs
    assert table_to_refs(refs_to_table([])) == []


def test_schema_lists_the_fields_in_order():
    assert REF_SCHEMA.names == list(SampleRef.__dataclass_fields__)


def test_a_table_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="missing column"):
        table_to_refs(pa.table({"key": ["a"]}))
