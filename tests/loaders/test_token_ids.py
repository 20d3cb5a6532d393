"""Token ids by reference (``loaders.token_ids``): the index's ids of every demo sample equal
tokenizing its text member again, for every source format; a sample decoded with them equals
one decoded by tokenizing; an index without ids falls back; a run with another tokenizer than
the index's refuses in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from omniscale.dataplane.spec import load_spec
from omniscale.errors import UserError
from omniscale.index_schema import METADATA_KEY, index_path
from omniscale.loaders.decode import SampleDecoder
from omniscale.loaders.decode_text import load_tokenizer
from omniscale.loaders.readers import SampleReader
from omniscale.loaders.token_ids import TokenIds, check_tokenizer
from tests.demo_data import copy_demo
from tests.loaders.decode_fixtures import demo_decoder, refs_of

FIELDS = ("input_ids_L", "labels_L", "position_ids_L", "mrope_3L")


def test_index_ids_equal_tokenizing_and_decode_alike(demo_root):
    spec = load_spec(demo_root / "mix.yaml")
    sources = {s.name: s.path for s in spec.sources}
    store = TokenIds(sources, max_shards=2)  # smaller than the shards: evictions happen
    reader = SampleReader(sources)
    tokenizer = load_tokenizer(spec.tokenizer).tokenizer
    with_ids = SampleDecoder(SampleReader(sources), spec.tokenizer, spec.media, store)
    without = demo_decoder(spec)
    formats = set()
    for source in spec.sources:
        refs = [r for r in refs_of(spec, source.name) if r.llm_tokens > 0]
        assert refs, source.name
        for ref in refs[:25]:
            text = [data for name, data in reader.read(ref).members if name.endswith(".txt")]
            want = tokenizer.encode(text[0].decode() if text else "",
                                    add_special_tokens=False).ids
            got = store.get(ref)
            assert got is not None and got.dtype == np.int64, (source.name, ref.key)
            assert got.tolist() == want, (source.name, ref.key)
            a, b = with_ids.decode(ref), without.decode(ref)
            for name in FIELDS:
                assert np.array_equal(getattr(a, name), getattr(b, name)), (ref.key, name)
            formats.add(ref.shard.rsplit(".", 1)[-1])
    assert {"tar", "parquet"} <= formats


def test_an_index_without_ids_is_tokenized_and_another_tokenizer_refused(demo_root, tmp_path):
    root = copy_demo(demo_root, tmp_path / "demo")
    spec = load_spec(root / "mix.yaml")
    source = next(s for s in spec.sources if s.name == "image_caption")
    ref = refs_of(spec, source.name)[0]
    check_tokenizer({source.name: source.path}, spec.tokenizer)  # the index's own: passes
    # An index of version 2 (no ids): the store has none, the decoder tokenizes.
    path = index_path(source.path)
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    pq.write_table(table.drop_columns(["text_ids"]).replace_schema_metadata(
        {METADATA_KEY: json.dumps({**meta, "version": 2})}), path)
    assert TokenIds({source.name: source.path}).get(ref) is None
    # Another tokenizer than the index's: one line naming the index and the source.
    other = tmp_path / "tokenizer.json"
    shutil.copy(spec.tokenizer, other)
    with open(other, "a") as f:
        f.write("\n")  # same vocabulary, other bytes: another sha256
    with pytest.raises(UserError) as e:
        check_tokenizer({source.name: source.path}, other)
    assert str(e.value).count("\n") == 0
    assert str(path) in str(e.value) and "'image_caption'" in str(e.value)
    assert "indexed with another tokenizer" in str(e.value)
