"""Pixels as a worker ships them, and the vision encoder's patches they become on the device.

A worker hands over what it decoded and nothing more: uint8 RGB, one row per frame of a patch,
in the encoder's patch order, as a numpy array (decoding never imports torch: the micro-batch
becomes tensors in ``loaders.collate``). An image is one frame (not the
``temporal_patch_size`` copies the encoder's 3D patches take); a clip's temporal patch is its
``temporal_patch_size`` frames. The model expands rows into normalised float patches on its
device (:func:`omniscale.encoders.vision_input.vision_patches`).

Qwen2-VL's patch layout: a patch vector is (channel, frame, row, col); patches of an item run
over (t, h/merge, w/merge, merge_row, merge_col), so each merge window's patches are adjacent.

Legend: T frames, H/W pixels, C channels (3), R pixel rows (a frame of a patch each), Q = C *
patch * patch.
"""

from __future__ import annotations

import numpy as np

from omniscale.geometry import MediaGeometry


def pixel_rows(frames_THWC: np.ndarray, g: MediaGeometry, video: bool
               ) -> tuple[np.ndarray, tuple[int, int, int]]:
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
    return rows_RQ, (t, h, w)


def row_width(g: MediaGeometry) -> int:
    """Q: values in one pixel row."""
    return 3 * g.patch_size ** 2
