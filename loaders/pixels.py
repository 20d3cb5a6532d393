"""Pixels as a worker ships them, and the vision encoder's patches they become on the device.

A worker hands over what it decoded and nothing more: uint8 RGB, one row per frame of a patch,
in the encoder's patch order. An image is one frame (not the ``temporal_patch_size`` copies the
encoder's 3D patches take); a clip's temporal patch is its ``temporal_patch_size`` frames. The
trainer expands rows into normalised float patches on its device (:func:`vision_patches`),
after the host-to-device copy: a quarter of the bytes for a clip, an eighth for an image, and
the arithmetic where it is cheap. The result equals decoding to float patches on the host
bit for bit (the same float32 operations in the same order).

Qwen2-VL's patch layout: a patch vector is (channel, frame, row, col); patches of an item run
over (t, h/merge, w/merge, merge_row, merge_col), so each merge window's patches are adjacent.

Legend: T frames, H/W pixels, C channels (3), R pixel rows (a frame of a patch each), Q = C *
patch * patch, P patches, D = C * temporal * patch * patch, V vision items.
"""

from __future__ import annotations

import numpy as np
import torch

from omniscale.kernels.transfer import host_to_device, to_device
from omniscale.loaders.geometry import MediaGeometry

# CLIP's statistics, which Qwen2-VL's vision tower was trained with.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def pixel_rows(frames_THWC: np.ndarray, g: MediaGeometry, video: bool
               ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 frames -> (rows uint8 [R, Q], patch grid (t, h, w)): an image is one frame
    (``t = 1``, a row per patch), a clip ``t * temporal_patch_size`` frames
    (``temporal_patch_size`` rows per patch, frame by frame)."""
    n, height, width, channels = frames_THWC.shape
    p, m, tp = g.patch_size, g.merge_size, g.temporal_patch_size
    per_patch = tp if video else 1
    if (n % per_patch if video else n != 1) or height % (p * m) or width % (p * m):
        raise ValueError(f"frames {n}x{height}x{width} do not tile into {per_patch}x"
                         f"{p * m}x{p * m}")
    t, h, w = n // per_patch, height // p, width // p
    x = frames_THWC.reshape(t, per_patch, h // m, m, p, w // m, m, p, channels)
    x = x.transpose(0, 2, 5, 3, 6, 1, 8, 4, 7)  # t, h/m, w/m, m, m, frame, C, p, p
    rows_RQ = np.ascontiguousarray(x).reshape(t * h * w * per_patch, channels * p * p)
    return torch.from_numpy(rows_RQ), (t, h, w)


def vision_patches(rows_RQ: torch.Tensor, grid_thw_V3: torch.Tensor, rows_V: torch.Tensor,
                   temporal: int) -> torch.Tensor:
    """Pixel rows (on any device) of items with these grids and ``rows_V`` rows each (a
    patch's frames: 1 for an image, ``temporal`` for a clip) -> the vision encoder's input:
    float32 [P, D], scaled to [0, 1] and standardised per channel, an image's frame repeated
    ``temporal`` times."""
    device = rows_RQ.device
    total = int(grid_thw_V3.prod(dim=1).sum())  # read where the grids are (no device sync)
    patches_V = host_to_device(grid_thw_V3, device).prod(dim=1)
    rows_V = host_to_device(rows_V, device)
    frames_V = rows_V // patches_V.clamp(min=1)
    # row of frame f of patch j of item v: its first row + j * frames + f (f = 0 for images)
    first_V = torch.cumsum(rows_V, 0) - rows_V
    patch_start_V = torch.cumsum(patches_V, 0) - patches_V
    frames_P = torch.repeat_interleave(frames_V, patches_V, output_size=total)
    j_P = torch.arange(total, device=device) - torch.repeat_interleave(
        patch_start_V, patches_V, output_size=total)
    first_P = torch.repeat_interleave(first_V, patches_V, output_size=total)
    step_F = torch.arange(temporal, device=device)
    src_PF = (first_P + j_P * frames_P)[:, None] + step_F[None, :] * (frames_P[:, None] > 1)
    channels = 3
    x = rows_RQ[src_PF].view(total, temporal, channels, rows_RQ.shape[1] // channels)
    x = x.transpose(1, 2)  # P, C, frame, patch * patch
    # host constants copied without waiting for the device (torch.tensor(..., device=cuda)
    # would wait: a blocking copy)
    mean, std = to_device([IMAGE_MEAN, IMAGE_STD], device, torch.float32).view(
        2, 1, channels, 1, 1)
    patches = (x.to(torch.float32) / 255.0 - mean) / std
    return patches.reshape(total, temporal * rows_RQ.shape[1])


def row_width(g: MediaGeometry) -> int:
    """Q: values in one pixel row."""
    return 3 * g.patch_size ** 2
