"""Pixel rows (what a worker ships) expand on the device to exactly the float patches the
host used to make: compared with an independent numpy implementation of Qwen2-VL's patch
layout (normalise, repeat an image's frame, tile), bit for bit."""

from __future__ import annotations

import numpy as np
import torch

from omniscale.encoders.vision_input import vision_patches
from omniscale.geometry import MediaGeometry
from omniscale.loaders.pixels import pixel_rows

G = MediaGeometry(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16,
                  max_pixels=64)
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def oracle_patches(frames_THWC: np.ndarray, g: MediaGeometry, video: bool) -> torch.Tensor:
    """float32 [t*h*w, C*tp*p*p]: frames normalised on the host, an image repeated over the
    temporal patch, then each patch vector laid out (channel, frame, row, col) with patches
    in (t, h/m, w/m, m, m) order."""
    x = (frames_THWC.astype(np.float32) / 255.0 - MEAN) / STD
    tp, p, m = g.temporal_patch_size, g.patch_size, g.merge_size
    if not video:
        x = np.repeat(x, tp, axis=0)
    n, height, width, c = x.shape
    t, h, w = n // tp, height // p, width // p
    out = np.empty((t, h // m, w // m, m, m, c, tp, p, p), np.float32)
    for ti in range(t):
        for hi in range(h):
            for wi in range(w):
                block = x[ti * tp:(ti + 1) * tp, hi * p:(hi + 1) * p, wi * p:(wi + 1) * p]
                out[ti, hi // m, wi // m, hi % m, wi % m] = block.transpose(3, 0, 1, 2)
    return torch.from_numpy(out.reshape(t * h * w, c * tp * p * p))


def test_rows_expand_to_the_host_patches_bit_for_bit():
    rng = np.random.default_rng(0)
    items = [(rng.integers(0, 256, (1, 8, 4, 3), dtype=np.uint8), False),
             (rng.integers(0, 256, (4, 4, 8, 3), dtype=np.uint8), True),
             (rng.integers(0, 256, (1, 4, 4, 3), dtype=np.uint8), False)]
    rows, grids, want = [], [], []
    for frames, video in items:
        r, grid = pixel_rows(frames, G, video)
        # numpy as decoded: the micro-batch becomes a tensor in loaders.collate
        assert isinstance(r, np.ndarray) and r.dtype == np.uint8
        assert r.shape[1] == 3 * G.patch_size ** 2
        rows.append(torch.from_numpy(r)), grids.append(grid)
        want.append(oracle_patches(frames, G, video))
    assert grids == [(1, 4, 2), (2, 2, 4), (1, 2, 2)]
    # an image ships one frame per patch, a clip its temporal patch's frames
    assert [len(r) for r in rows] == [8, 2 * 16, 4]
    got = vision_patches(torch.cat(rows), torch.tensor(grids), torch.tensor([len(r) for r in rows]),
                         G.temporal_patch_size)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.cat(want))
    # the bytes handed over: an eighth (image) and a quarter (clip) of the float patches
    assert rows[0].numel() * 8 == want[0].numel() * 4 and rows[1].numel() * 4 == \
        want[1].numel() * 4


def test_patches_are_in_merge_window_order_and_an_image_repeats_its_frame():
    # Pixel value = its column in channel 0, its row in channel 1.
    frames = np.zeros((1, 8, 8, 3), np.uint8)
    frames[..., 0] = np.arange(8)[None, None, :]
    frames[..., 1] = np.arange(8)[None, :, None]
    rows, grid = pixel_rows(frames, G, video=False)
    patches = vision_patches(torch.from_numpy(rows), torch.tensor([grid]),
                             torch.tensor([len(rows)]), 2)
    assert grid == (1, 4, 4) and patches.shape == (16, 3 * 2 * 2 * 2)
    pixels = (patches.view(16, 3, 2, 4) * torch.from_numpy(STD).view(1, 3, 1, 1)
              + torch.from_numpy(MEAN).view(1, 3, 1, 1)) * 255
    top_left = [(round(float(p[1].min())), round(float(p[0].min()))) for p in pixels[:5]]
    assert top_left == [(0, 0), (0, 2), (2, 0), (2, 2), (0, 4)]  # a 2x2 merge window first
    assert torch.equal(patches.view(16, 3, 2, 4)[:, :, 0], patches.view(16, 3, 2, 4)[:, :, 1])


def test_no_items_no_patches():
    long = torch.int64
    out = vision_patches(torch.zeros(0, 12, dtype=torch.uint8), torch.zeros(0, 3, dtype=long),
                         torch.zeros(0, dtype=long), 2)
    assert out.shape == (0, 24)
