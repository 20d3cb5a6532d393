"""Real omni batches for model tests: demo samples through the loaders' own decode and collate.

Demo image, video and audio caption samples are rendered on the spot (tools.demo), decoded by
loaders' decoders, laid out by ``loaders.sequence.build_sequence`` and packed by
``loaders.collate.collate`` -- the path a trainer's batches take, minus the plane. The media
geometry is shrunk so a training step takes milliseconds on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omniscale.geometry import MediaGeometry, audio_tokens, vision_tokens
from omniscale.loaders.collate import PackedBatch, collate
from omniscale.loaders.decode_audio import decode_audio
from omniscale.loaders.decode_image import decode_image
from omniscale.loaders.decode_text import load_tokenizer, tokenize
from omniscale.loaders.decode_video import decode_video
from omniscale.loaders.sequence import DecodedSample, ItemSlot, MediaItem, build_sequence
from omniscale.tools.demo import audio as demo_audio
from omniscale.tools.demo import image as demo_image
from omniscale.tools.demo import video as demo_video
from omniscale.tools.demo.tokenizer import train_tokenizer

GEOMETRY = MediaGeometry(max_pixels=84 * 84, video_max_pixels=56 * 56, video_max_frames=4,
                         audio_max_seconds=1.0)
RENDER = {"image": demo_image.sample, "video": demo_video.sample, "audio": demo_audio.sample}
DECODE = {"image": decode_image, "video": decode_video}


def render(kinds: list[str], seed: int = 0) -> list[tuple[str, bytes, str]]:
    """(kind, media bytes, caption) per demo sample."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in kinds:
        members, _ = RENDER[kind](rng)
        media = next(b for suffix, b in members if suffix not in ("txt", "json"))
        caption = next(b for suffix, b in members if suffix == "txt")
        out.append((kind, media, caption))
    return out


def tokenizer(captions: list[bytes], path: Path):
    train_tokenizer([], [c.decode() for c in captions], path, vocab_size=512)
    return load_tokenizer(path)


def decoded(kind: str, media: bytes, caption: bytes, tok, g: MediaGeometry = GEOMETRY
            ) -> DecodedSample:
    """One caption sample as the loaders decode it: media block first, then the caption."""
    if kind == "audio":
        mel = decode_audio(media, g)
        item = MediaItem(kind, mel, None, int(mel.shape[0]), -1, audio_tokens(mel.shape[0]))
        slot = ItemSlot(kind, item.num_tokens)
    else:
        vision = DECODE[kind](media, g)
        item = MediaItem(kind, vision.rows_RQ, vision.grid_thw, None, -1,
                         vision_tokens(vision.grid_thw, g))
        t, h, w = vision.grid_thw
        slot = ItemSlot(kind, item.num_tokens, (t, h // g.merge_size, w // g.merge_size))
    _, ids = tokenize(caption, tok)
    seq = build_sequence(ids, [slot], tok)
    item.token_start = seq.token_starts[0]
    return DecodedSample(kind, "demo", seq.input_ids_L, seq.labels_L, seq.position_ids_L,
                         seq.mrope_3L, tok.pad_id, [item])


def text_sample(text: bytes, tok) -> DecodedSample:
    """A text-only sample (no media item at all)."""
    _, ids = tokenize(text, tok)
    seq = build_sequence(ids, [], tok)
    return DecodedSample("text", "demo", seq.input_ids_L, seq.labels_L, seq.position_ids_L,
                         seq.mrope_3L, tok.pad_id, [])


def batch(samples: list[DecodedSample], g: MediaGeometry = GEOMETRY) -> PackedBatch:
    return collate([(s, 1, 0) for s in samples], g)
