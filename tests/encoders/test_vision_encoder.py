"""The vision encoder: token counts match the geometry, packing changes nothing, real patches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniscale.encoders.vision import VisionConfig, VisionEncoder
from omniscale.encoders.vision_input import vision_patches
from omniscale.geometry import MediaGeometry, vision_tokens
from omniscale.loaders.decode_image import decode_image
from omniscale.tools.demo import image as demo_image

G = MediaGeometry()
OUT = 48


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return VisionEncoder(VisionConfig.preset("tiny"), OUT).eval()


def random_grids(rng, n):
    return [(int(rng.integers(1, 4)), 2 * int(rng.integers(1, 6)), 2 * int(rng.integers(1, 6)))
            for _ in range(n)]


def patches_for(grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, VisionConfig().patch_dim, generator=g)


def test_token_counts_match_geometry(encoder):
    rng = np.random.default_rng(0)
    for _ in range(5):
        grids = random_grids(rng, int(rng.integers(1, 5)))
        with torch.no_grad():
            out = encoder(patches_for(grids), torch.tensor(grids))
        assert out.shape == (sum(vision_tokens(g, G) for g in grids), OUT)
        assert encoder.output_lengths(torch.tensor(grids)).tolist() == [
            vision_tokens(g, G) for g in grids]


def test_packed_items_match_items_alone(encoder):
    grids = [(1, 4, 6), (2, 2, 2), (1, 8, 4), (3, 4, 2)]
    x = patches_for(grids, seed=1)
    with torch.no_grad():
        packed = encoder(x, torch.tensor(grids))
        alone = [encoder(chunk, torch.tensor([g]))
                 for chunk, g in zip(x.split([t * h * w for t, h, w in grids]), grids)]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_clip_attends_within_each_temporal_patch_group(encoder):
    """A clip (t, h, w) encodes as t independent (1, h, w) slices: the documented window."""
    grid = (3, 4, 4)
    x = patches_for([grid], seed=2)
    with torch.no_grad():
        clip = encoder(x, torch.tensor([grid]))
        slices = encoder(x, torch.tensor([(1, 4, 4)] * 3))
    torch.testing.assert_close(clip, slices, rtol=1e-5, atol=1e-5)


def test_positions_matter(encoder):
    """2D rotary positions: the same patches in a different grid shape give other outputs."""
    x = patches_for([(1, 4, 8)], seed=3)
    with torch.no_grad():
        a = encoder(x, torch.tensor([(1, 4, 8)]))
        b = encoder(x, torch.tensor([(1, 8, 4)]))
    assert not torch.allclose(a, b, atol=1e-3)


def test_real_demo_image():
    g = MediaGeometry(max_pixels=112 * 112)
    members, _ = demo_image.sample(np.random.default_rng(5))
    data = next(b for suffix, b in members if suffix in ("jpg", "png", "jpeg", "webp"))
    item = decode_image(data, g)
    torch.manual_seed(0)
    enc = VisionEncoder(VisionConfig.preset("tiny"), OUT)
    enc.config.check_geometry(g)
    grid = torch.tensor([item.grid_thw])
    patches = vision_patches(torch.from_numpy(item.rows_RQ), grid,
                             torch.tensor([len(item.rows_RQ)]), g.temporal_patch_size)
    out = enc(patches, grid)
    assert out.shape == (vision_tokens(item.grid_thw, g), OUT)
    assert torch.isfinite(out).all()


def test_bad_inputs_name_the_problem(encoder):
    with pytest.raises(ValueError, match="multiples of merge_size"):
        encoder(patches_for([(1, 3, 4)]), torch.tensor([(1, 3, 4)]))
    with pytest.raises(ValueError, match="pixel_patches has"):
        encoder(patches_for([(1, 4, 4)]), torch.tensor([(1, 4, 2)]))
    with pytest.raises(ValueError, match="must match"):
        VisionConfig.preset("tiny").check_geometry(MediaGeometry(patch_size=16))
