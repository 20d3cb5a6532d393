"""One shard of one source: the unit of work the generator hands to its process pool.

A shard's bytes depend only on its task: sample ``i`` of (source, split) draws from
``numpy.random.default_rng([seed, source_id, split_id, i])``, so the dataset is the same
whatever the number of workers and whatever order the shards finish in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omniscale.tools.demo import audio, chat, image, interleaved, text, video, writer

# Stable ids: they seed the per-sample generators, so changing one changes the data.
SOURCE_IDS = {"text": 0, "docs": 1, "image_caption": 2, "video_caption": 3,
              "audio_caption": 4, "interleaved": 5, "chat": 6}
SPLIT_IDS = {"train": 0, "eval": 1}
SAMPLERS = {"image_caption": image.sample, "video_caption": video.sample,
            "audio_caption": audio.sample, "chat": chat.sample}


@dataclass(frozen=True)
class ShardTask:
    """Write samples ``[start, start + count)`` of (source, split) to ``path``.

    ``rows`` carries the data of sources that are read rather than drawn: (text, provenance)
    pairs for ``text``, (key, text) rows for ``docs``.
    """

    source: str
    split: str
    index: int
    start: int
    count: int
    path: Path
    seed: int
    rows: tuple = field(default=(), repr=False)
    row_group_size: int = 8


@dataclass(frozen=True)
class ShardResult:
    source: str
    split: str
    index: int
    samples: int
    bytes: int
    captions: list[str]  # text the tokenizer must cover: captions and interleaved documents


def sample_key(split: str, i: int) -> str:
    """``train-000042``: no dots, so WebDataset keeps the whole key."""
    return f"{split}-{i:06d}"


def sample_rng(seed: int, source: str, split: str, i: int) -> np.random.Generator:
    return np.random.default_rng([seed, SOURCE_IDS[source], SPLIT_IDS[split], i])


def write_shard(task: ShardTask) -> ShardResult:
    """Generate and write one shard; runs in a worker process."""
    captions: list[str] = []
    if task.source == "docs":
        size = writer.write_parquet(task.path, list(task.rows), task.row_group_size)
        return ShardResult(task.source, task.split, task.index, len(task.rows), size, captions)
    docs = text.topics() if task.source == "interleaved" else []
    samples = []
    for offset in range(task.count):
        i = task.start + offset
        if task.source == "text":
            members = text.text_members(*task.rows[offset])
        else:
            rng = sample_rng(task.seed, task.source, task.split, i)
            if task.source == "interleaved":
                members, texts = interleaved.sample(rng, docs)
            else:
                members, texts = SAMPLERS[task.source](rng)
            captions += texts
        samples.append((sample_key(task.split, i), members))
    size = writer.write_tar(task.path, samples)
    return ShardResult(task.source, task.split, task.index, task.count, size, captions)
