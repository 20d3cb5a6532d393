"""Video bytes -> sampled frames at the target size -> uint8 pixel rows in the vision
encoder's patch order (``loaders.pixels``, temporal patches of ``temporal_patch_size`` frames)
and a ``(t, h, w)`` grid.

The container's header is probed first (``loaders.probe.video_header``: a demux without
decoding, bounded in frame size and packets), so garbage bytes and huge frames are refused
before a decoder allocates anything; the header's frame size gives the target size
(``geometry.video_resize``, the formula the index used, so ``t*h*w`` equals the index's
``video_patches``). decord then decodes the frames at ``geometry.video_frame_indices``
already scaled to that size by FFmpeg's bicubic scaler -- no full-size frame is ever made,
and nothing else is decoded. decord 0.6 gets frames exactly 48 or 72 pixels wide wrong
(4-channel garbage or an error, dmlc/decord#93, #336): those sizes, and any clip whose frames
do not come back with the expected shape, are decoded with PyAV, scaled by the same scaler.

Tolerance: scaling in FFmpeg instead of PIL (and from YUV rather than from RGB) moves pixel
values by about 1.3 to 2.8 levels of 255 on average over the demo's clips, never the grid;
``tests/loaders/test_decode.py`` holds decoded clips to within 4 levels on average of a
full-size decode resized by PIL.
"""

from __future__ import annotations

import io

import numpy as np

from omniscale.geometry import MediaGeometry, video_frame_indices, video_resize
from omniscale.loaders.decode_image import VisionItem
from omniscale.loaders.pixels import pixel_rows
from omniscale.loaders.probe import Corrupt, short, video_header

# Decoding walks the stream up to the last sampled frame; this bounds that walk in PyAV.
MAX_DECODED_FRAMES = 1 << 16
DECORD_BAD_WIDTHS = (48, 72)  # frame widths decord 0.6 decodes wrongly


def decode_video(data: bytes, g: MediaGeometry) -> VisionItem:
    """Pixel rows and grid of a clip; :class:`Corrupt` for anything unusable."""
    header = video_header(data)  # raises Corrupt for garbage, no frames, or oversized frames
    try:
        height, width = video_resize(header.height, header.width, g)
    except ValueError as e:
        raise Corrupt(short(e)) from None
    frames_THWC = _decord_frames(data, g, height, width)
    if frames_THWC is None:
        frames_THWC = _pyav_frames(data, g, height, width)
    return VisionItem(*pixel_rows(frames_THWC, g, video=True))


def _decord_frames(data: bytes, g: MediaGeometry, height: int, width: int
                   ) -> np.ndarray | None:
    """Sampled RGB frames [T, height, width, 3] uint8 from decord, or None when decord gets
    it wrong."""
    import decord

    if width in DECORD_BAD_WIDTHS:
        return None
    try:
        reader = decord.VideoReader(io.BytesIO(data), num_threads=1, width=width,
                                    height=height)
        n, fps = len(reader), reader.get_avg_fps()
        if n <= 0:
            return None
        wanted = video_frame_indices(n, fps, g)
        frames = reader.get_batch(wanted).asnumpy()
    except Exception:  # noqa: BLE001 -- decord raises its own untyped errors; PyAV decides
        return None
    if frames.shape != (len(wanted), height, width, 3) or frames.dtype != np.uint8:
        return None
    return frames


def _pyav_frames(data: bytes, g: MediaGeometry, height: int, width: int) -> np.ndarray:
    """Sampled RGB frames [T, height, width, 3] uint8 decoded with PyAV, counting frames as
    the index did (the stream's frame count, else its packets)."""
    import av
    from av.video.reformatter import VideoReformatter

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
        # One scaler for the clip's frames: ``VideoFrame.reformat`` builds FFmpeg's scaler
        # context afresh for every frame (0.8 ms a frame against 0.15, the same pixels). Not
        # kept past the clip: freed in a forked child, its slice threads' condition variables
        # hang ``pthread_cond_destroy`` (tests/loaders/test_decode.py).
        scaler = VideoReformatter()
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            stream = container.streams.video[0]
            stream.thread_type = "NONE"
            for i, frame in enumerate(container.decode(stream)):
                if i >= MAX_DECODED_FRAMES:
                    raise Corrupt(f"video has more than {MAX_DECODED_FRAMES} frames")
                if i in wanted:
                    picked[i] = scaler.reformat(frame, width=width, height=height,
                                                format="rgb24",
                                                interpolation="BICUBIC").to_ndarray()
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
