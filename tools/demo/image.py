"""The ``image_caption`` source: one drawn scene per sample, its caption and its labels.

Members: ``KEY.jpg`` (most) or ``KEY.png`` (about one in five), ``KEY.txt`` (the caption),
``KEY.json`` (the scene: background and a list of {shape, color, size, position}, plus the
image size and format).
"""

from __future__ import annotations

import io
import json

import numpy as np
from PIL import Image, ImageDraw

from omniscale.tools.demo import scenes

MIN_SIDE, MAX_SIDE, MAX_ASPECT = 64, 1024, 3.0
PNG_SHARE = 0.2


def render(rng: np.random.Generator, lo: int = MIN_SIDE,
           hi: int = MAX_SIDE) -> tuple[dict, str, bytes]:
    """Draw a random scene of random size; returns (labels, extension, encoded bytes).

    Sides lie in [lo, hi] with aspect ratios up to 3:1. The bytes are a pure function of the
    generator's state (Pillow's encoders write no timestamps).
    """
    scene = scenes.random_scene(rng)
    width, height = scenes.random_size(rng, lo, hi, MAX_ASPECT)
    ext = "png" if rng.random() < PNG_SHARE else "jpg"
    img = Image.new("RGB", (width, height), scenes.BACKGROUNDS[scene["background"]])
    scenes.draw_scene(ImageDraw.Draw(img), scene, width, height)
    buf = io.BytesIO()
    if ext == "png":
        img.save(buf, format="PNG")
    else:
        img.save(buf, format="JPEG", quality=90)
    labels = {**scene, "width": width, "height": height, "format": ext}
    return labels, ext, buf.getvalue()


def sample(rng: np.random.Generator) -> tuple[list[tuple[str, bytes]], list[str]]:
    """Members (suffix, bytes) of one image-caption sample, and its text for the tokenizer."""
    labels, ext, data = render(rng)
    caption = scenes.image_caption(labels)
    members = [(ext, data), ("txt", caption.encode()),
               ("json", json.dumps(labels, sort_keys=True).encode())]
    return members, [caption]
