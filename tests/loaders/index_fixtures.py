"""Small real media files, tokenizers and shards for the source-index tests."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np

from omniscale.layout import SPECIAL_TOKENS

SENTENCES = [
    "a photo of a cat sitting on a red chair",
    "the quick brown fox jumps over the lazy dog",
    "<image> a dog runs on the beach <video> and a bird sings <audio>",
    "speech about the weather in the mountains, recorded outdoors",
]


def write_tokenizer(path: Path) -> Path:
    """A tiny byte-level BPE tokenizer whose special tokens are omniscale.layout's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(SENTENCES * 5, trainer)
    tokenizer.save(str(path))
    return path


def image_bytes(width: int, height: int, fmt: str = "JPEG") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(width * 1000 + height)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def video_bytes(frames: int, fps: int, width: int, height: int, fmt: str = "mp4",
                textured: bool = False) -> bytes:
    """A clip of flat grey frames, or of random pixels (``textured``: a flat clip scales
    alike under any filter)."""
    import av

    rng = np.random.default_rng(width * 1000 + height)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            pixels = (rng.integers(0, 256, (height, width, 3), dtype=np.uint8) if textured
                      else np.full((height, width, 3), (i * 20) % 255, np.uint8))
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def empty_video_bytes() -> bytes:
    """An mp4 whose video track holds no frames."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()
    return buf.getvalue()


def audio_bytes(seconds: float, sample_rate: int, fmt: str = "WAV") -> bytes:
    import soundfile

    n = int(seconds * sample_rate)
    wave = (0.1 * np.sin(np.arange(n) * 0.05)).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, wave, sample_rate, format=fmt)
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return path


def caption_members(key: str, text: str, **media: bytes) -> list[tuple[str, bytes]]:
    """Members of one sample: ``KEY.txt`` plus ``KEY.<suffix>`` for each media item."""
    members = [(f"{key}.txt", text.encode())]
    members += [(f"{key}.{suffix.replace('_', '.')}", data) for suffix, data in media.items()]
    return members


def write_jsonl(path: Path, records: list[dict | bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for record in records:
            f.write(record if isinstance(record, bytes) else json.dumps(record).encode())
            f.write(b"\n")
    return path
