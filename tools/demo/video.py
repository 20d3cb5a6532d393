"""The ``video_caption`` source: a shape crossing a plain background, as an H.264 MP4 clip.

Members: ``KEY.mp4`` (yuv420p, so both sides are even), ``KEY.txt`` (``a red circle moves
left.``), ``KEY.json`` (shape, color, direction, background, frames, fps, width, height).
"""

from __future__ import annotations

import io
import json
import math

import av
import numpy as np
from PIL import Image, ImageDraw

from omniscale.tools.demo import scenes

MIN_SIDE, MAX_SIDE, MAX_ASPECT = 32, 320, 3.0
MIN_FRAMES, MAX_FRAMES = 4, 64
FPS = 8
# decord 0.6 decodes clips exactly 48 or 72 pixels wide as 4-channel garbage
# (dmlc/decord#93, #336); the demo keeps clear of them so its clips decode everywhere.
DECORD_BAD_WIDTHS = frozenset({48, 72})


def encode_mp4(frames: list[np.ndarray], fps: int) -> bytes:
    """H.264 MP4 of RGB frames (H, W, 3), byte-identical for identical input.

    Why the options: ``+bitexact`` keeps the muxer from writing encoder versions and times
    that vary, and one x264 thread makes the bitstream independent of scheduling.
    """
    height, width = frames[0].shape[:2]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream(
            "libx264", rate=fps, options={"preset": "ultrafast", "crf": "23", "threads": "1"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1
        for array in frames:
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def render(rng: np.random.Generator) -> tuple[dict, list[np.ndarray]]:
    """A random clip: labels and its frames. The shape travels 80% of the free span along
    its direction, centred, so it stays fully visible and its motion is unambiguous."""
    width, height = scenes.random_size(rng, MIN_SIDE, MAX_SIDE, MAX_ASPECT, multiple=2)
    width += 2 * (width in DECORD_BAD_WIDTHS)
    n_frames = int(round(math.exp(rng.uniform(math.log(MIN_FRAMES), math.log(MAX_FRAMES)))))
    labels = {"shape": scenes.pick(rng, scenes.SHAPES), "color": scenes.pick(rng, scenes.COLORS),
              "direction": scenes.pick(rng, scenes.DIRECTIONS),
              "background": scenes.pick(rng, scenes.BACKGROUNDS),
              "frames": n_frames, "fps": FPS, "width": width, "height": height}
    side = max(4.0, 0.3 * min(width, height))
    dx, dy = scenes.DIRECTIONS[labels["direction"]]
    span_x, span_y = 0.8 * (width - side), 0.8 * (height - side)
    background = scenes.BACKGROUNDS[labels["background"]]
    fill = scenes.COLORS[labels["color"]]
    frames = []
    for t in range(n_frames):
        progress = t / (n_frames - 1) - 0.5  # -0.5 .. 0.5
        cx = width / 2 + dx * span_x * progress
        cy = height / 2 + dy * span_y * progress
        img = Image.new("RGB", (width, height), background)
        scenes.draw_shape(ImageDraw.Draw(img), labels["shape"], cx, cy, side, fill)
        frames.append(np.asarray(img))
    return labels, frames


def sample(rng: np.random.Generator) -> tuple[list[tuple[str, bytes]], list[str]]:
    """Members (suffix, bytes) of one video-caption sample, and its text for the tokenizer."""
    labels, frames = render(rng)
    caption = scenes.video_caption(labels)
    members = [("mp4", encode_mp4(frames, FPS)), ("txt", caption.encode()),
               ("json", json.dumps(labels, sort_keys=True).encode())]
    return members, [caption]
