"""The demo's mixing specs: ``mix.yaml`` (training curriculum) and ``eval.yaml`` (held out).

Both follow docs/mixing-spec.md. The media geometry is sized for CPUs (8-pixel patches, at most
16k pixels per image) so the demo trains end to end on a laptop.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

MEDIA = {
    "patch_size": 8, "merge_size": 2, "temporal_patch_size": 2,
    "min_pixels": 1024, "max_pixels": 16384,
    "video_fps": 4.0, "video_min_frames": 4, "video_max_frames": 16, "video_max_pixels": 4096,
    "audio_sample_rate": 16000, "audio_max_seconds": 30.0,
}

# A curriculum in four segments, one of each kind: text-heavy warm-up, a linear ramp that
# brings in every modality, a cosine shift towards media, and a step back to a text-leaning
# mix for the tail of the run.
WARMUP = {"text": 4, "docs": 1, "image_caption": 1}
RAMPED = {"text": 3, "docs": 1, "image_caption": 2, "video_caption": 1, "audio_caption": 1,
          "interleaved": 1}
MEDIA_HEAVY = {"text": 2, "docs": 1, "image_caption": 2, "video_caption": 2, "audio_caption": 2,
               "interleaved": 2}
COOLDOWN = {"text": 3, "docs": 1, "image_caption": 1, "video_caption": 1, "audio_caption": 1,
            "interleaved": 2}
SCHEDULE = {"unit": "steps", "segments": [
    {"kind": "const", "start": 0, "end": 50, "weights": WARMUP},
    {"kind": "linear", "start": 50, "end": 200, "from": WARMUP, "to": RAMPED},
    {"kind": "cosine", "start": 200, "end": 400, "from": RAMPED, "to": MEDIA_HEAVY},
    {"kind": "step", "start": 400, "end": None, "at": 600, "from": MEDIA_HEAVY, "to": COOLDOWN},
]}


def _source(name: str, split: str, fmt: str, template: str) -> dict:
    return {"name": name, "path": f"{split}/{name}", "format": fmt, "template": template}


def _only(weights: dict[str, float], names) -> dict[str, float]:
    """``weights`` restricted to ``names``; equal weights if none of them is left."""
    kept = {n: w for n, w in weights.items() if n in names}
    return kept or {n: 1 for n in names}


def mix_spec(seed: int, sources: dict[str, tuple[str, str]]) -> dict:
    """The training spec over ``sources`` ({name: (format, template)}) with the curriculum;
    weight maps name only those sources (a partial plan still yields a valid spec)."""
    segments = [{k: _only(v, sources) if k in ("weights", "from", "to") else v
                 for k, v in segment.items()} for segment in SCHEDULE["segments"]]
    return {"seed": seed, "tokenizer": "tokenizer.json", "accounting": "tokens",
            "on_exhausted": "next_epoch", "media": dict(MEDIA),
            "sources": [_source(n, "train", f, t) for n, (f, t) in sources.items()],
            "schedule": {"unit": SCHEDULE["unit"], "segments": segments}}


def eval_spec(seed: int, sources: dict[str, tuple[str, str]]) -> dict:
    """The held-out spec: every eval source at equal constant weight, stopping when spent."""
    return {"seed": seed, "tokenizer": "tokenizer.json", "accounting": "samples",
            "on_exhausted": "stop", "media": dict(MEDIA),
            "sources": [{**_source(n, "eval", f, t), "weight": 1}
                        for n, (f, t) in sources.items()]}


def task_spec(seed: int, sources: dict[str, tuple[str, str]]) -> dict:
    """A single-task training spec (the ``lm`` and ``video_gen`` demos): the given train
    sources at equal constant weight, in tokens, cycling epochs."""
    return {"seed": seed, "tokenizer": "tokenizer.json", "accounting": "tokens",
            "on_exhausted": "next_epoch", "media": dict(MEDIA),
            "sources": [{**_source(n, "train", f, t), "weight": 1}
                        for n, (f, t) in sources.items()]}


def write_spec(path: Path, spec: dict, header: str) -> None:
    """YAML in the spec's own key order, under a ``#`` comment header."""
    comment = "".join(f"# {line}\n" for line in header.strip().splitlines())
    # A JSON round trip unshares the weight maps, which would otherwise come out as YAML
    # anchors and aliases: legal, but hard to read.
    body = yaml.safe_dump(json.loads(json.dumps(spec)), sort_keys=False)
    path.write_text(comment + body)


def every_source_spec(demo: Path, out: Path) -> Path:
    """A copy of ``demo``'s mix.yaml with every source at equal weight from step 0 (its
    schedule starts with text and images only), written to ``out`` with absolute paths: steps
    that hold video and audio for both encoders (tests and benchmarks)."""
    spec = yaml.safe_load((demo / "mix.yaml").read_text())
    spec.pop("schedule", None)
    spec["tokenizer"] = str(demo / spec["tokenizer"])
    spec["sources"] = [dict(s, path=str(demo / s["path"]), weight=1) for s in spec["sources"]]
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out
