"""Pixel rows (as a loader ships them, :mod:`omniscale.loaders.pixels`) -> the vision
encoder's input, on the model's device.

The rows cross host to device as uint8 (a quarter of the bytes for a clip, an eighth for an
image) and become normalised float patches where the arithmetic is cheap. The result equals
decoding to float patches on the host bit for bit (the same float32 operations in the same
order).

Legend: R pixel rows, Q = C * patch * patch, P patches, D = C * temporal * patch * patch,
V vision items.
"""

from __future__ import annotations

import torch

from omniscale.kernels.transfer import host_to_device, to_device

# CLIP's statistics, which Qwen2-VL's vision tower was trained with.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)



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
