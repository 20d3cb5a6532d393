"""Refs, readers and decoders over the real demo data and hand-made shards, for the loader
tests (readers, decoders, sequence, collate)."""

from __future__ import annotations

from pathlib import Path

from omniscale.dataplane.spec import MixSpec
from omniscale.geometry import MediaGeometry
from omniscale.index_schema import read_index
from omniscale.loaders.decode import SampleDecoder
from omniscale.loaders.readers import SampleReader
from omniscale.loaders.tar_scan import scan_tar
from omniscale.refs import SampleRef


def demo_decoder(spec: MixSpec, max_open: int = 16) -> SampleDecoder:
    reader = SampleReader({s.name: s.path for s in spec.sources}, max_open=max_open)
    return SampleDecoder(reader, spec.tokenizer, spec.media, special=spec.special_tokens)


def ref_of(source: str, row: dict, source_id: int = 0) -> SampleRef:
    """The ref the plane would serve for an index row (uncapped)."""
    return SampleRef(
        source_id, source, row["shard"], row["key"], row["offset"], row["size"],
        tuple((m["name"], m["offset"], m["size"]) for m in row["members"] or ()),
        row["llm_tokens"], row["text_tokens"], tuple(row["image_patches"]),
        tuple(row["video_patches"]), tuple(row["audio_frames"]))


def refs_of(spec: MixSpec, source: str) -> list[SampleRef]:
    path = next(s.path for s in spec.sources if s.name == source)
    return [ref_of(source, row) for row in read_index(path).to_pylist()]


def tar_refs(source: str, path: Path) -> list[SampleRef]:
    """Refs without cost features (``llm_tokens=0``) of a hand-written tar's samples."""
    return [SampleRef(0, source, path.name, s.key, s.offset, s.size,
                      tuple((m.name, m.offset, m.size) for m in s.members))
            for s in scan_tar(path).samples]


def hand_decoder(source: str, directory: Path, tokenizer: Path,
                 geometry: MediaGeometry | None = None) -> SampleDecoder:
    return SampleDecoder(SampleReader({source: directory}), tokenizer,
                         geometry or MediaGeometry(patch_size=8, max_pixels=64 * 64,
                                                   min_pixels=16 * 16, video_max_pixels=64 * 64))
