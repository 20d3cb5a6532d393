"""The video DiT: packing is exact, patchify round-trips, and rectified flow learns demo clips."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch
from PIL import Image

from omniscale.backbone.config import MoEConfig
from omniscale.backbone.dit import DiTConfig, VideoDiT, patchify_video, unpatchify_video
from omniscale.tools.demo import video as demo_video

PATCH, TPATCH, FRAMES = 8, 2, 4


def decode_clip(data: bytes, side: int = 24) -> tuple[torch.Tensor, bytes]:
    """FRAMES evenly spaced RGB frames of an MP4, short side resized to ``side`` (both sides
    multiples of the patch), in [-1, 1]: [T, H, W, 3]."""
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    pick = np.linspace(0, len(frames) - 1, FRAMES).round().astype(int)
    h, w = frames[0].shape[:2]
    scale = side / min(h, w)
    th = max(PATCH, round(h * scale / PATCH) * PATCH)
    tw = max(PATCH, min(3 * side, round(w * scale / PATCH) * PATCH))
    resized = [np.asarray(Image.fromarray(frames[i]).resize((tw, th), Image.BILINEAR))
               for i in pick]
    return torch.from_numpy(np.stack(resized)).float() / 127.5 - 1.0


@pytest.fixture(scope="module")
def clips():
    """Packed patches, grids and byte-token captions of a few demo video samples."""
    rng = np.random.default_rng(0)
    patches, grids, captions = [], [], []
    for _ in range(4):
        members, _ = demo_video.sample(rng)
        parts = dict(members)
        x_PC, grid = patchify_video(decode_clip(parts["mp4"]), PATCH, TPATCH)
        patches.append(x_PC)
        grids.append(grid)
        captions.append(torch.tensor(list(parts["txt"]), dtype=torch.long))
    offsets = torch.tensor([0] + [len(c) for c in captions[:-1]]).cumsum(0)
    return torch.cat(patches), torch.tensor(grids), torch.cat(captions), offsets


def test_patchify_round_trips():
    frames = torch.randn(4, 16, 24, 3)
    x_PC, grid = patchify_video(frames, PATCH, TPATCH)
    assert grid == (2, 2, 3) and x_PC.shape == (12, 3 * TPATCH * PATCH * PATCH)
    torch.testing.assert_close(unpatchify_video(x_PC, grid, PATCH, TPATCH), frames)


@pytest.mark.parametrize("moe", [None, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=64)])
def test_packed_clips_match_clips_alone(clips, moe):
    x_PC, grids, ids, offsets = clips
    torch.manual_seed(0)
    model = VideoDiT(DiTConfig.preset("tiny", moe=moe))
    for p in model.parameters():  # leave adaLN-Zero's zero init, which hides most of the net
        torch.nn.init.normal_(p, std=0.05)
    t_V = torch.linspace(0.1, 0.9, len(grids))
    ends = offsets.tolist()[1:] + [len(ids)]
    with torch.no_grad():
        packed, _ = model.velocity(x_PC, t_V, grids, ids, offsets)
        sizes = grids.prod(dim=1).tolist()
        alone = [model.velocity(x, t_V[v:v + 1], grids[v:v + 1], ids[a:b], torch.tensor([0]))[0]
                 for v, (x, a, b) in enumerate(zip(x_PC.split(sizes), offsets.tolist(), ends))]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-4, atol=1e-5)


def test_loss_falls_on_demo_clips(clips):
    x_PC, grids, ids, offsets = clips
    torch.manual_seed(0)
    model = VideoDiT(DiTConfig.preset("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def fixed_loss() -> float:  # same times and noise each time: a fair before/after
        with torch.no_grad():
            out = model(x_PC, grids, ids, offsets, generator=torch.Generator().manual_seed(1))
        return (out["loss_sum"] / out["n_tokens"]).item()

    before = fixed_loss()
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        out = model(x_PC, grids, ids, offsets, generator=gen)
        loss = out["loss_sum"] / out["n_tokens"] + out["router_loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = fixed_loss()
    assert after < 0.75 * before, (before, after)
    sample = model.sample(grids, ids, offsets, steps=2, generator=torch.Generator().manual_seed(2))
    assert sample.shape == x_PC.shape and torch.isfinite(sample).all()
