"""Cost features of one media member from its headers, never by decoding pixels or samples.

Each probe takes the member's bytes, or for images and audio a seekable file over the member
(``loaders.ranged_file.MemberFile``: the parser reads only the header bytes it needs, so a
remote shard's payloads stay where they are; a PNG is the exception, ``verify`` reads its
chunks to check them) and returns what ``omniscale.geometry`` needs: an image's pixel size, a
clip's frame count, frame rate and frame size, an audio clip's sample count and rate --
already turned into a patch grid or log-mel frame count. Files are untrusted: every parser
call is bounded and any failure becomes :class:`Corrupt` with a short reason instead of an
exception escaping the indexer.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from typing import BinaryIO

from omniscale.geometry import MediaGeometry, audio_mel_frames, image_grid, video_grid

# Formats the image decoders accept; restricting PIL's sniffing also shrinks the parser
# surface an untrusted file can reach.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")
# A frame larger than 8K x 8K is no training clip; refuse before anyone allocates it.
MAX_VIDEO_FRAME_PIXELS = 8192 * 8192
# Demuxing to count packets is bounded by the member's bytes; this bounds it in packets too.
MAX_VIDEO_PACKETS = 1 << 22


class Corrupt(Exception):
    """A member or sample that cannot be used; the message is one short line saying why."""


@contextlib.contextmanager
def untrusted_image():
    """PIL on untrusted bytes: a decompression-bomb warning is a refusal, and every parser
    failure becomes :class:`Corrupt` with a short reason. Shared by the index's header probe
    and the decoder, so both refuse the same files with the same words."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            # PIL only warns between MAX_IMAGE_PIXELS and twice that; a warning is a refusal.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except Corrupt:
        raise
    except Image.UnidentifiedImageError:
        raise Corrupt("not an image (cannot identify image file)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise Corrupt(f"image too large ({short(e)})") from None
    except Exception as e:  # noqa: BLE001 -- untrusted bytes: any parser failure is corruption
        raise Corrupt(f"not a valid image ({short(e)})") from None


def probe_image(data: bytes | BinaryIO, g: MediaGeometry) -> tuple[int, int, int]:
    """Patch grid ``(1, h, w)`` of an image, from its header (PIL's lazy ``open``)."""
    from PIL import Image

    with untrusted_image():
        with Image.open(_file(data), formats=IMAGE_FORMATS) as image:
            width, height = image.size
            image.verify()
    try:
        return image_grid(height, width, g)
    except ValueError as e:
        raise Corrupt(short(e)) from None


@dataclass(frozen=True)
class VideoHeader:
    """What a clip's container says: frame count, rate and frame size."""

    frames: int
    fps: float
    height: int
    width: int


def probe_video(data: bytes, g: MediaGeometry) -> tuple[int, int, int]:
    """Patch grid ``(t, h, w)`` of a clip from container and stream metadata."""
    header = video_header(data)
    try:
        return video_grid(header.frames, header.fps, header.height, header.width, g)
    except ValueError as e:
        raise Corrupt(short(e)) from None


def video_header(data: bytes) -> VideoHeader:
    """A clip's :class:`VideoHeader`, demuxed without decoding; :class:`Corrupt` for garbage,
    no frames or frames above ``MAX_VIDEO_FRAME_PIXELS``.

    When the container does not state the frame count (Matroska, WebM) the packets of the
    video stream are counted by demuxing, which reads no pixels.
    """
    import av

    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.video:
                # Demuxers drop a track without samples, so "no frames" looks like this too.
                raise Corrupt("video has no frames (no video stream)")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate
            fps = float(rate) if rate else 0.0
            frames = stream.frames or _count_packets(container, stream)
    except Corrupt:
        raise
    except Exception as e:  # noqa: BLE001 -- untrusted bytes: any demuxer failure is corruption
        raise Corrupt(f"not a video ({short(e)})") from None
    if frames <= 0:
        raise Corrupt("video has no frames")
    if width <= 0 or height <= 0:
        raise Corrupt(f"video frame size {width}x{height} is not positive")
    if width * height > MAX_VIDEO_FRAME_PIXELS:
        raise Corrupt(f"video frame size {width}x{height} is above {MAX_VIDEO_FRAME_PIXELS} "
                      "pixels")
    return VideoHeader(frames, fps, height, width)


def _count_packets(container, stream) -> int:
    count = 0
    for packet in container.demux(stream):
        if packet.size > 0:  # the demuxer ends with an empty flush packet
            count += 1
            if count > MAX_VIDEO_PACKETS:
                raise Corrupt(f"video has more than {MAX_VIDEO_PACKETS} packets")
    return count


def probe_audio(data: bytes | BinaryIO, g: MediaGeometry) -> int:
    """Log-mel frame count of a clip from its header (sample count and rate)."""
    import soundfile

    try:
        info = soundfile.info(_file(data))
    except Exception as e:  # noqa: BLE001 -- untrusted bytes: any parser failure is corruption
        # libsndfile's message names the file object (an address that differs per run): the
        # reason alone keeps the index the same from run to run.
        raise Corrupt(f"not audio ({short(getattr(e, 'error_string', None) or e)})") from None
    if info.frames <= 0:
        raise Corrupt("audio has no samples")
    try:
        return audio_mel_frames(info.frames, info.samplerate, g)
    except ValueError as e:
        raise Corrupt(short(e)) from None


def _file(data: bytes | BinaryIO) -> BinaryIO:
    return io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data


def decode_text(data: bytes) -> str:
    """The member's text; strict UTF-8, because a decoder that guesses tokenizes garbage."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Corrupt(f"not UTF-8 (byte 0x{data[e.start]:02x} at byte {e.start})") from None


def short(e: BaseException, limit: int = 160) -> str:
    """An exception as one short line (library messages can span lines or quote objects)."""
    # OSError-style errors (FFmpeg's included) say it best without errno and file name.
    text = " ".join(str(getattr(e, "strerror", None) or e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"
