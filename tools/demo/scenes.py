"""Synthetic scenes: coloured shapes on a plain background, and the captions that describe them.

Shared by the image, video and interleaved sources. The vocabulary is small and the grammar is
fixed so that a small model can learn to ground every word in the pixels:

- image: ``a large red circle at the top left, a small green star at the top and a small blue
  square in the center on a white background.``
- video: ``a red circle moves left.``

A scene is a list of labels (plain dicts, JSON-ready); the caption is a pure function of the
labels, so a test can check every caption against its ``KEY.json``.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import ImageDraw

SHAPES = ("circle", "square", "triangle", "star", "cross")
COLORS = {
    "red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220),
    "yellow": (240, 210, 30), "purple": (140, 50, 170), "orange": (245, 130, 20),
}
# Backgrounds share no colour name with the shapes, so a caption never names a colour twice.
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
SIZES = {"small": 0.45, "large": 0.9}  # shape side as a fraction of the grid cell
POSITIONS = ("top left", "top", "top right", "left", "center", "right",
             "bottom left", "bottom", "bottom right")  # row-major over the 3x3 grid
DIRECTIONS = {
    "left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1),
    "up and left": (-1, -1), "up and right": (1, -1),
    "down and left": (-1, 1), "down and right": (1, 1),
}


def pick(rng: np.random.Generator, options) -> str:
    """One element of a tuple or of a dict's keys, by the given generator."""
    options = tuple(options)
    return options[int(rng.integers(len(options)))]


def random_size(rng: np.random.Generator, lo: int, hi: int, max_aspect: float,
                multiple: int = 1) -> tuple[int, int]:
    """(width, height) with the long side log-uniform in [lo, hi] and aspect ratio up to
    ``max_aspect``; both sides in [lo, hi] and multiples of ``multiple``."""
    long_side = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    aspect = math.exp(rng.uniform(0.0, math.log(max_aspect)))
    sides = [long_side, long_side / aspect]
    if rng.random() < 0.5:
        sides.reverse()
    w, h = (min(hi, max(lo, int(s) // multiple * multiple)) for s in sides)
    return w, h


def random_scene(rng: np.random.Generator) -> dict:
    """A background and 1-3 shapes, each in its own cell of the 3x3 grid."""
    n = int(rng.integers(1, 4))
    cells = rng.choice(len(POSITIONS), size=n, replace=False)
    shapes = [{"shape": pick(rng, SHAPES), "color": pick(rng, COLORS), "size": pick(rng, SIZES),
               "position": POSITIONS[int(c)]} for c in sorted(cells)]
    return {"background": pick(rng, BACKGROUNDS), "shapes": shapes}


def _where(position: str) -> str:
    return "in the center" if position == "center" else f"at the {position}"


def image_caption(scene: dict) -> str:
    """The caption of a scene: every shape in grid order, then the background."""
    parts = [f"a {s['size']} {s['color']} {s['shape']} {_where(s['position'])}"
             for s in scene["shapes"]]
    shapes = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    return f"{shapes} on a {scene['background']} background."


def video_caption(labels: dict) -> str:
    return f"a {labels['color']} {labels['shape']} moves {labels['direction']}."


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, side: float,
               fill: tuple[int, int, int]) -> None:
    """Draw ``shape`` filling a square of ``side`` pixels centred on (cx, cy)."""
    r = side / 2
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
    elif shape == "star":
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.45
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=fill)
    elif shape == "cross":
        t = r / 3
        draw.rectangle([cx - t, cy - r, cx + t, cy + r], fill=fill)
        draw.rectangle([cx - r, cy - t, cx + r, cy + t], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def draw_scene(draw: ImageDraw.ImageDraw, scene: dict, width: int, height: int) -> None:
    """Paint the scene's shapes; each sits centred in its grid cell, sized by the cell."""
    cw, ch = width / 3, height / 3
    for s in scene["shapes"]:
        row, col = divmod(POSITIONS.index(s["position"]), 3)
        side = max(3.0, SIZES[s["size"]] * min(cw, ch))
        draw_shape(draw, s["shape"], (col + 0.5) * cw, (row + 0.5) * ch, side, COLORS[s["color"]])
