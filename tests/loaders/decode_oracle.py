"""The test oracle for cost features: measure each one by decoding the whole payload.

The index computes features from headers only; these functions decode everything (pixels,
frames, samples) and push the result through the same geometry, so a test can assert that the
two agree on any source -- the tests' own fixtures and the real demo data alike.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from omniscale.geometry import (
    MediaGeometry,
    audio_tokens,
    image_grid,
    video_frame_indices,
    video_grid,
    vision_tokens,
)
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, media_order, member_kind


def full_decode_features(kind: str, data: bytes, g: MediaGeometry) -> tuple[int, int]:
    """(feature, LLM tokens) of one media item measured by decoding all of it."""
    if kind == "image":
        from PIL import Image

        image = Image.open(io.BytesIO(data))
        image.load()
        grid = image_grid(image.height, image.width, g)
        return int(np.prod(grid)), vision_tokens(grid, g)
    if kind == "video":
        import decord

        reader = decord.VideoReader(io.BytesIO(data))
        n, fps = len(reader), reader.get_avg_fps()
        height, width = reader[0].shape[:2]
        grid = video_grid(n, fps, height, width, g)
        frames = reader.get_batch(video_frame_indices(n, fps, g)).shape[0]
        assert frames == grid[0] * g.temporal_patch_size
        return int(np.prod(grid)), vision_tokens(grid, g)
    import soundfile
    import torch
    import torchaudio

    wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    wave = torch.from_numpy(wave.T.copy()).mean(0)
    wave = torchaudio.functional.resample(wave, rate, g.audio_sample_rate)
    wave = wave[:int(g.audio_max_seconds * g.audio_sample_rate)]
    mel = torchaudio.transforms.MelSpectrogram(sample_rate=g.audio_sample_rate, n_fft=400,
                                               hop_length=160, n_mels=g.n_mels)(wave)
    return mel.shape[-1], audio_tokens(mel.shape[-1])


def text_tokens_of(tokenizer_path, text: str) -> int:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    markers = {tokenizer.token_to_id(m) for m in DEFAULT_SPECIAL_TOKENS.markers.values()}
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return len(ids) - sum(i in markers for i in ids) + 1


def assert_row_matches_full_decode(source: Path, row: dict, tokenizer_path: Path,
                                   g: MediaGeometry) -> set[str]:
    """Check one tar-source index row against a full decode; return the kinds it held.

    Also checks that every member's byte range holds the member's exact bytes and that the
    sample's range starts at a tar header and covers all its members.
    """
    import tarfile

    shard = source / row["shard"]
    data = shard.read_bytes()
    with tarfile.open(shard) as tar:
        truth = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    expected = {"image": [], "video": [], "audio": []}
    llm_media, text, kinds = 0, "", set()
    assert row["error"] is None, (row["key"], row["error"])
    assert row["members"], row["key"]
    for member in sorted(row["members"], key=lambda m: media_order(m["name"].split(".", 1)[1])):
        payload = data[member["offset"]:member["offset"] + member["size"]]
        assert payload == truth[member["name"]], (row["key"], member["name"])
        assert row["offset"] <= member["offset"] - 512
        assert member["offset"] + member["size"] <= row["offset"] + row["size"]
        kind = member_kind(member["name"].split(".", 1)[1])
        kinds.add(kind)
        if kind == "text":
            text = payload.decode()
        elif kind in expected:
            feature, tokens = full_decode_features(kind, payload, g)
            expected[kind].append(feature)
            llm_media += tokens
    assert row["image_patches"] == expected["image"], row["key"]
    assert row["video_patches"] == expected["video"], row["key"]
    assert row["audio_frames"] == expected["audio"], row["key"]
    assert row["text_tokens"] == text_tokens_of(tokenizer_path, text), row["key"]
    assert row["llm_tokens"] == row["text_tokens"] + llm_media, row["key"]
    return kinds
