"""Image bytes -> Qwen2-VL-style patches and their ``(t, h, w)`` grid.

The image is resized with ``loaders.geometry.image_resize`` (the formula the index used on the
header's size), so ``len(patches) == t*h*w`` equals the index's ``image_patches``. Patches are
laid out in merge-window order: each ``merge x merge`` group of neighbouring patches is
contiguous, which is what the vision merger reshapes into one LLM token.

Legend: T frames, C channels (3), H/W pixels, P patches, D = C * temporal * patch * patch.

Files are untrusted: the declared size is bounded before any pixel is decoded (decompression
bombs), the parser set is restricted, and a truncated file is refused even if someone set
PIL's process-wide ``LOAD_TRUNCATED_IMAGES``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch

from omniscale.loaders.geometry import MediaGeometry, image_resize
from omniscale.loaders.probe import IMAGE_FORMATS, Corrupt, untrusted_image

# CLIP's statistics, which Qwen2-VL's vision tower was trained with.
IMAGE_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
IMAGE_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
# Decoding allocates width*height*4 bytes before any resize: 64 MP (256 MB) is the most a
# worker decodes. PIL's own MAX_IMAGE_PIXELS check is process-wide and user-settable.
MAX_IMAGE_PIXELS = 1 << 26


@dataclass(frozen=True)
class VisionItem:
    """One image or clip ready for the vision encoder."""

    patches_PD: torch.Tensor  # float32 [t*h*w, C * temporal * patch * patch]
    grid_thw: tuple[int, int, int]


class _EofWatch(io.BytesIO):
    """A buffer that remembers whether a decoder asked for bytes past its end.

    A decoder that is still reading at the end of the data has a truncated file; PIL hides
    this when ``ImageFile.LOAD_TRUNCATED_IMAGES`` is set (it feeds a fake end marker).
    """

    hit_eof = False

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        if size != 0 and not data:
            self.hit_eof = True
        return data


def decode_image(data: bytes, g: MediaGeometry) -> VisionItem:
    """Patches and grid of an image; :class:`Corrupt` for anything unusable."""
    from PIL import Image

    buf = _EofWatch(data)
    with untrusted_image():
        with Image.open(buf, formats=IMAGE_FORMATS) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise Corrupt(f"image size {width}x{height} is above {MAX_IMAGE_PIXELS} "
                              "pixels")
            target_h, target_w = image_resize(height, width, g)
            if image.format == "JPEG":
                # Decode at the smallest DCT scale still >= the target: same output size,
                # a fraction of the work for photos far larger than max_pixels.
                image.draft("RGB", (target_w, target_h))
            buf.hit_eof = False  # headers may probe to the end; pixels must not
            image.load()
            if buf.hit_eof:
                raise Corrupt("image file is truncated")
            rgb = image.convert("RGB")
    pixels_HWC = resize_rgb(rgb, target_h, target_w)
    # An image is one frame; the encoder's 3D patches want `temporal` frames, so it repeats.
    frames_THWC = np.repeat(pixels_HWC[None], g.temporal_patch_size, axis=0)
    return VisionItem(*patchify(frames_THWC, g))


def resize_rgb(image, height: int, width: int) -> np.ndarray:
    """An RGB PIL image resized (bicubic) and normalised: float32 [H, W, C]."""
    from PIL import Image

    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return normalize(np.asarray(image))


def normalize(pixels_HWC: np.ndarray) -> np.ndarray:
    """uint8 RGB pixels ``[..., C]`` -> float32, scaled to [0, 1] and standardised."""
    return (pixels_HWC.astype(np.float32) / 255.0 - IMAGE_MEAN) / IMAGE_STD


def patchify(frames_THWC: np.ndarray, g: MediaGeometry
             ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames -> (patches [t*h*w, C*tp*p*p] in merge-window order, grid (t, h, w)).

    Qwen2-VL's layout: a patch vector is (channel, frame, row, col); patches run over
    (t, h/merge, w/merge, merge_row, merge_col).
    """
    n, height, width, channels = frames_THWC.shape
    p, m, tp = g.patch_size, g.merge_size, g.temporal_patch_size
    if n % tp or height % (p * m) or width % (p * m):
        raise ValueError(f"frames {n}x{height}x{width} do not tile into {tp}x{p * m}x{p * m}")
    t, h, w = n // tp, height // p, width // p
    x = frames_THWC.transpose(0, 3, 1, 2)  # T C H W
    x = x.reshape(t, tp, channels, h // m, m, p, w // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    patches_PD = np.ascontiguousarray(x).reshape(t * h * w, channels * tp * p * p)
    return torch.from_numpy(patches_PD), (t, h, w)
