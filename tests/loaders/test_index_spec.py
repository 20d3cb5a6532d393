"""Indexing through a mixing spec: every source, with the spec's tokenizer and geometry."""

from __future__ import annotations

import textwrap

from omniscale.index_schema import read_index_metadata
from omniscale.loaders.index import index_paths
from omniscale.loaders.text_cost import tokenizer_fingerprint
from tests.loaders.index_fixtures import (
    caption_members,
    image_bytes,
    write_jsonl,
    write_tar,
    write_tokenizer,
)


def test_spec_indexes_all_sources_with_its_geometry(tmp_path):
    tokenizer = write_tokenizer(tmp_path / "tok.json")
    write_tar(tmp_path / "train" / "pics" / "pics-0.tar",
              caption_members("a", "a cat", jpg=image_bytes(64, 64)))
    write_tar(tmp_path / "train" / "pics" / "pics-1.tar",
              caption_members("b", "a dog", jpg=image_bytes(32, 48)))
    write_jsonl(tmp_path / "train" / "chat" / "chat-0.jsonl", [{"text": "hello"}])
    spec = tmp_path / "mix.yaml"
    spec.write_text(textwrap.dedent("""\
        tokenizer: tok.json
        media: {patch_size: 8, max_pixels: 16384}
        sources:
          - {name: pics, path: train/pics, format: webdataset, template: image_caption}
          - {name: chat, path: train/chat, format: jsonl, template: text}
        schedule:
          unit: steps
          segments:
            - {kind: const, start: 0, end: null, weights: {pics: 1, chat: 1}}
        """))
    reports = index_paths([spec], workers=2, progress=False)
    assert [(r.source, r.samples, r.shards_indexed) for r in reports] == [
        ("pics", 2, 2), ("chat", 1, 1)]
    meta = read_index_metadata(tmp_path / "train" / "pics")
    assert meta["geometry"]["patch_size"] == 8 and meta["format"] == "webdataset"
    assert meta["tokenizer_sha256"] == tokenizer_fingerprint(tokenizer)
    # The directory alone keeps the geometry its index was made with: nothing to redo.
    again, = index_paths([tmp_path / "train" / "pics"], tokenizer=tokenizer, progress=False)
    assert (again.shards_indexed, again.shards_unchanged) == (0, 2)
