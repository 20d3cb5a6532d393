"""Media geometry: how a raw image, video or audio clip becomes encoder patches and LLM tokens.

One set of formulas shared by the source index (which computes cost features from file headers
only) and the decoders (which produce the tensors). Keeping them in one place is what makes
"the index's cost features equal what a full decode measures" true by construction; the tests
check it against real decodes.

Conventions (Qwen2-VL style):
- images are resized to multiples of ``patch_size * merge_size`` with the pixel count kept in
  ``[min_pixels, max_pixels]``; an image is a grid ``(t=1, h, w)`` of patches;
- videos are sampled at ``video_fps`` (clamped to ``[video_min_frames, video_max_frames]`` and
  rounded down to a multiple of ``temporal_patch_size``), each frame resized like an image but
  bounded by ``video_max_pixels``; a clip is a grid ``(t, h, w)`` with ``t = frames / temporal``;
- the vision merger turns ``merge_size**2`` patches into one LLM token;
- audio is resampled to ``audio_sample_rate``, truncated to ``audio_max_seconds``, turned into
  log-mel frames with ``mel_hop`` (centered STFT: ``n // hop + 1`` frames), and the audio
  encoder subsamples by 4 with two stride-2 convolutions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class MediaGeometry:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 32
    video_max_pixels: int = 224 * 224
    audio_sample_rate: int = 16_000
    audio_max_seconds: float = 30.0
    mel_hop: int = 160
    mel_n_fft: int = 400
    n_mels: int = 80
    max_aspect_ratio: float = 200.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"media.{f.name}: must be > 0, got {getattr(self, f.name)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError("media.min_pixels: must be <= media.max_pixels")
        if self.video_min_frames > self.video_max_frames:
            raise ValueError("media.video_min_frames: must be <= media.video_max_frames")
        if self.video_min_frames < self.temporal_patch_size:
            raise ValueError("media.video_min_frames: must be >= media.temporal_patch_size")

    @property
    def factor(self) -> int:
        """Side lengths are multiples of this many pixels."""
        return self.patch_size * self.merge_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "MediaGeometry":
        return cls(**(d or {}))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 max_aspect_ratio: float = 200.0) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within bounds, aspect kept."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {width}x{height}: both sides must be positive")
    if max(height, width) / min(height, width) > max_aspect_ratio:
        raise ValueError(f"image size {width}x{height}: aspect ratio above {max_aspect_ratio:g}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_resize(height: int, width: int, g: MediaGeometry) -> tuple[int, int]:
    return smart_resize(height, width, g.factor, g.min_pixels, g.max_pixels, g.max_aspect_ratio)


def image_grid(height: int, width: int, g: MediaGeometry) -> tuple[int, int, int]:
    """Patch grid ``(1, h, w)`` of an image of the given pixel size."""
    h, w = image_resize(height, width, g)
    return 1, h // g.patch_size, w // g.patch_size


def video_frame_count(n_frames: int, fps: float, g: MediaGeometry) -> int:
    """Frames the decoder samples from a clip of ``n_frames`` at ``fps``."""
    if n_frames <= 0:
        raise ValueError("video has no frames")
    duration = n_frames / fps if fps > 0 else n_frames / g.video_fps
    want = round(duration * g.video_fps)
    want = min(max(want, g.video_min_frames), g.video_max_frames)
    return max(g.temporal_patch_size, want // g.temporal_patch_size * g.temporal_patch_size)


def video_frame_indices(n_frames: int, fps: float, g: MediaGeometry) -> list[int]:
    """Indices of the frames the decoder reads: evenly spaced, repeats allowed for short clips."""
    k = video_frame_count(n_frames, fps, g)
    if k == 1:
        return [0]
    return [round(i * (n_frames - 1) / (k - 1)) for i in range(k)]


def video_resize(height: int, width: int, g: MediaGeometry) -> tuple[int, int]:
    return smart_resize(height, width, g.factor, g.min_pixels,
                        min(g.max_pixels, g.video_max_pixels), g.max_aspect_ratio)


def video_grid(n_frames: int, fps: float, height: int, width: int,
               g: MediaGeometry) -> tuple[int, int, int]:
    """Patch grid ``(t, h, w)`` of a clip: temporal patches by spatial patches."""
    h, w = video_resize(height, width, g)
    t = video_frame_count(n_frames, fps, g) // g.temporal_patch_size
    return t, h // g.patch_size, w // g.patch_size


def audio_samples(n_samples: int, sample_rate: int, g: MediaGeometry) -> int:
    """Samples after resampling to ``audio_sample_rate`` and truncating to the maximum length."""
    if n_samples <= 0:
        raise ValueError("audio has no samples")
    if sample_rate <= 0:
        raise ValueError(f"audio sample rate {sample_rate} is not positive")
    n = math.ceil(n_samples * g.audio_sample_rate / sample_rate)
    return min(n, int(g.audio_max_seconds * g.audio_sample_rate))


def audio_mel_frames(n_samples: int, sample_rate: int, g: MediaGeometry) -> int:
    """Log-mel frames of a clip (centered STFT; clips shorter than one FFT are zero-padded)."""
    n = max(audio_samples(n_samples, sample_rate, g), g.mel_n_fft)
    return n // g.mel_hop + 1


def audio_tokens(mel_frames: int) -> int:
    """LLM tokens the audio encoder emits: two stride-2 convolutions (kernel 3, padding 1)."""
    t = (mel_frames - 1) // 2 + 1
    return (t - 1) // 2 + 1


def vision_tokens(grid_thw: tuple[int, int, int], g: MediaGeometry) -> int:
    """LLM tokens the vision merger emits for one image or clip grid."""
    t, h, w = grid_thw
    return t * h * w // (g.merge_size ** 2)
