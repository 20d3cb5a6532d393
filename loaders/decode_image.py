"""Image bytes -> uint8 pixel rows in Qwen2-VL's patch order and their ``(t, h, w)`` grid.

The image is resized with ``omniscale.geometry.image_resize`` (the formula the index used on the
header's size), so the ``t*h*w`` patches equal the index's ``image_patches``. The rows are
``loaders.pixels``' layout (one frame, in merge-window order); the trainer's device normalises
them and repeats the frame over the encoder's temporal patch.

Legend: H/W pixels, C channels (3), R pixel rows, Q = C * patch * patch.

Files are untrusted: the declared size is bounded before any pixel is decoded (decompression
bombs), the parser set is restricted, and a truncated file is refused even if someone set
PIL's process-wide ``LOAD_TRUNCATED_IMAGES``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from omniscale.geometry import MediaGeometry, image_resize
from omniscale.loaders.pixels import pixel_rows
from omniscale.loaders.probe import IMAGE_FORMATS, Corrupt, untrusted_image

# Decoding allocates width*height*4 bytes before any resize: 64 MP (256 MB) is the most a
# worker decodes. PIL's own MAX_IMAGE_PIXELS check is process-wide and user-settable.
MAX_IMAGE_PIXELS = 1 << 26


@dataclass(frozen=True)
class VisionItem:
    """One image or clip ready for the vision encoder."""

    rows_RQ: np.ndarray  # uint8 [R, Q]: loaders.pixels' rows (a frame of a patch each)
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
    """Pixel rows and grid of an image; :class:`Corrupt` for anything unusable."""
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
    return VisionItem(*pixel_rows(resize_rgb(rgb, target_h, target_w)[None], g, video=False))


def resize_rgb(image, height: int, width: int) -> np.ndarray:
    """An RGB PIL image resized (bicubic): uint8 [H, W, C]."""
    from PIL import Image

    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(image)
