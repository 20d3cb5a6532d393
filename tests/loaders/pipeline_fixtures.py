"""A plane on the tiny demo with every source in the mix from step 0, and the checks the
pipeline tests share: per-sample decoding of a plan, and PackedBatch equality."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch
import yaml

from omniscale.dataplane.plane import PlaneConfig
from omniscale.dataplane.spec import MixSpec, load_spec
from omniscale.loaders.collate import PackedBatch, collate
from omniscale.plan import plan_metadata
from omniscale.refs import table_to_refs

CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=2, snapshot_every=4)
SOURCES = ("text", "docs", "image_caption", "video_caption", "audio_caption", "interleaved")


def all_modalities_spec(demo: Path, name: str = "all.yaml", extra: dict | None = None,
                        weights: dict | None = None) -> Path:
    """The demo's training spec with every source weighted from step 0 (the demo's own
    curriculum keeps video and audio out for its first 50 steps)."""
    spec = yaml.safe_load((demo / "mix.yaml").read_text())
    spec["sources"] += list((extra or {}).values())
    w = weights or {s: 1 for s in SOURCES} | {"text": 0.25}
    spec["schedule"] = {"unit": "steps", "segments": [
        {"kind": "const", "start": 0, "end": None, "weights": w}]}
    path = demo / name
    path.write_text(yaml.safe_dump(spec))
    return path


def loader_args(spec: MixSpec) -> dict:
    return {"sources": {s.name: s.path for s in spec.sources}, "tokenizer_path": spec.tokenizer,
            "geometry": spec.media}


def expected_batches(table, decoder, geometry) -> list[PackedBatch]:
    """What the rank's micro-batches must be: each ref decoded on its own, then collated."""
    rows = table.to_pylist()
    refs = table_to_refs(table)
    micro = [[] for _ in range(plan_metadata(table)["num_micro_batches"])]
    trained = [[] for _ in micro]
    for ref, row in zip(refs, rows):
        if row["role"] == "llm":
            micro[row["micro_batch"]].append((decoder.decode(ref), row["sp_size"],
                                              row["sp_index"], row["sp_slices"]))
            trained[row["micro_batch"]].append(ref)
    batches = [collate(mb, geometry) for mb in micro]
    for batch, refs_of_mb in zip(batches, trained):
        batch.seq_refs = refs_of_mb
    return batches


def assert_same_batch(got: PackedBatch, want: PackedBatch) -> None:
    for f in fields(PackedBatch):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def modalities(batch: PackedBatch) -> set[str]:
    kinds = {("image", "video")[k] for k in batch.vision_kind_V.tolist()}
    kinds |= {"audio"} if batch.audio_frames_A.numel() else set()
    kinds |= {"text"} if batch.num_tokens else set()
    return kinds


def spec_of(path: Path) -> MixSpec:
    return load_spec(path)
