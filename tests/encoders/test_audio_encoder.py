"""The audio encoder: x4 subsampling equals geometry.audio_tokens, packing changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniscale.encoders.audio import AudioConfig, AudioEncoder
from omniscale.geometry import MediaGeometry, audio_tokens
from omniscale.loaders.decode_audio import decode_audio
from omniscale.tools.demo import audio as demo_audio

OUT = 48


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return AudioEncoder(AudioConfig.preset("tiny"), OUT).eval()


def mel(frames, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(frames), 80, generator=g)


def test_token_counts_match_geometry(encoder):
    rng = np.random.default_rng(0)
    cases = [[1], [2], [3], [4], [5], [1, 2, 3, 4, 5, 6, 7, 8]]
    cases += [rng.integers(1, 400, size=int(rng.integers(1, 5))).tolist() for _ in range(4)]
    for frames in cases:
        with torch.no_grad():
            out = encoder(mel(frames), torch.tensor(frames))
        assert out.shape == (sum(audio_tokens(f) for f in frames), OUT), frames
        assert encoder.output_lengths(torch.tensor(frames)).tolist() == [
            audio_tokens(f) for f in frames]


def test_packed_clips_match_clips_alone(encoder):
    frames = [37, 3, 120, 8, 1]
    x = mel(frames, seed=1)
    with torch.no_grad():
        packed = encoder(x, torch.tensor(frames))
        alone = [encoder(chunk, torch.tensor([n])) for chunk, n in zip(x.split(frames), frames)]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_real_demo_audio():
    g = MediaGeometry(audio_max_seconds=2.0)
    members, _ = demo_audio.sample(np.random.default_rng(3))
    data = next(b for suffix, b in members if suffix in ("wav", "flac"))
    mel_RB = torch.from_numpy(decode_audio(data, g))  # decoders yield numpy
    torch.manual_seed(0)
    enc = AudioEncoder(AudioConfig.preset("tiny"), OUT)
    enc.config.check_geometry(g)
    out = enc(mel_RB, torch.tensor([mel_RB.shape[0]]))
    assert out.shape == (audio_tokens(mel_RB.shape[0]), OUT)
    assert torch.isfinite(out).all()


def test_bad_inputs_name_the_problem(encoder):
    with pytest.raises(ValueError, match="mel tensor has"):
        encoder(mel([10]), torch.tensor([9]))
    with pytest.raises(ValueError, match=r"\[frames, 80\]"):
        encoder(torch.zeros(4, 40), torch.tensor([4]))
