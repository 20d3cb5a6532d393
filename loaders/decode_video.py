"""Video bytes -> sampled frames -> 3D patches (temporal patch size 2) and a ``(t, h, w)`` grid.

Frames are read with decord at ``geometry.video_frame_indices`` and resized with
``geometry.video_resize``, the formulas the index used, so ``t*h*w`` equals the index's
``video_patches``.

Untrusted input: the container's header is probed first (``loaders.probe.probe_video``: a
demux without decoding, bounded in frame size and packets), so garbage bytes and huge frames
are refused before decord allocates anything. decord 0.6 decodes clips exactly 48 or 72 pixels
wide as 4-channel garbage (dmlc/decord#93, #336) or fails on them; whenever its frames do not
have the probed shape, the clip is decoded again with PyAV.
"""

from __future__ import annotations

import io

import numpy as np

from omniscale.loaders.decode_image import VisionItem, patchify, resize_rgb
from omniscale.loaders.geometry import MediaGeometry, video_frame_indices, video_resize
from omniscale.loaders.probe import Corrupt, probe_video, short

# Decoding walks the stream up to the last sampled frame; this bounds that walk in PyAV.
MAX_DECODED_FRAMES = 1 << 16


def decode_video(data: bytes, g: MediaGeometry) -> VisionItem:
    """Patches and grid of a clip; :class:`Corrupt` for anything unusable."""
    probe_video(data, g)  # raises Corrupt for garbage, no frames, or oversized frames
    frames_THWC = _decord_frames(data, g)
    if frames_THWC is None:
        frames_THWC = _pyav_frames(data, g)
    height, width = frames_THWC.shape[1:3]
    try:
        target_h, target_w = video_resize(height, width, g)
    except ValueError as e:
        raise Corrupt(short(e)) from None
    from PIL import Image

    resized = np.stack([resize_rgb(Image.fromarray(frame), target_h, target_w)
                        for frame in frames_THWC])
    return VisionItem(*patchify(resized, g))


def _decord_frames(data: bytes, g: MediaGeometry) -> np.ndarray | None:
    """Sampled RGB frames [T, H, W, 3] uint8 from decord, or None when decord gets it wrong."""
    import decord

    try:
        reader = decord.VideoReader(io.BytesIO(data), num_threads=1)
        n, fps = len(reader), reader.get_avg_fps()
        if n <= 0:
            return None
        first = reader[0].asnumpy()
        if first.ndim != 3 or first.shape[2] != 3:
            return None  # the 48/72-pixel-wide bug: 4 channels of garbage
        frames = reader.get_batch(video_frame_indices(n, fps, g)).asnumpy()
    except Exception:  # noqa: BLE001 -- decord raises its own untyped errors; PyAV decides
        return None
    if frames.ndim != 4 or frames.shape[1:] != first.shape or frames.dtype != np.uint8:
        return None
    return frames


def _pyav_frames(data: bytes, g: MediaGeometry) -> np.ndarray:
    """Sampled RGB frames [T, H, W, 3] uint8 decoded with PyAV, counting frames as the index
    did (the stream's frame count, else its packets)."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            stream = container.streams.video[0]
            rate = stream.average_rate
            fps = float(rate) if rate else 0.0
            n = stream.frames or sum(1 for p in container.demux(stream) if p.size > 0)
        if n <= 0:
            raise Corrupt("video has no frames")
        wanted = video_frame_indices(n, fps, g)
        picked: dict[int, np.ndarray] = {}
        last = None
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            stream = container.streams.video[0]
            stream.thread_type = "NONE"
            for i, frame in enumerate(container.decode(stream)):
                if i >= MAX_DECODED_FRAMES:
                    raise Corrupt(f"video has more than {MAX_DECODED_FRAMES} frames")
                if i in wanted:
                    picked[i] = frame.to_ndarray(format="rgb24")
                last = i
                if i >= wanted[-1]:
                    break
    except Corrupt:
        raise
    except Exception as e:  # noqa: BLE001 -- untrusted bytes: any decoder failure is corruption
        raise Corrupt(f"not a decodable video ({short(e)})") from None
    if last is None:
        raise Corrupt("video has no decodable frames")
    # A stream that decodes fewer frames than it declares repeats its last one, as decord does.
    tail = picked[max(picked)] if picked else None
    if tail is None:
        raise Corrupt("video has no decodable frames at the sampled positions")
    return np.stack([picked.get(i, tail) for i in wanted])
