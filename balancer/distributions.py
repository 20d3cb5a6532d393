"""Built-in sample-length generators for simulating the balancer without a dataset.

Each generator draws ``n`` samples from a seeded ``numpy.random.Generator`` and returns them as
one :class:`WindowSamples` (every sample in batch 0; the simulator cuts the stream into steps),
so the same (name, n, seed) always gives the same arrays.

``omni`` follows the shape of a real omni-modal mix: text with a long-tailed length, images at
Qwen2-VL-style resolution (sides rounded to multiples of 28, area within
[56², 1280·28²] pixels, one patch per 14×14 pixels, 2×2 patches merged into one LLM token),
videos (two frames per temporal patch) and audio (100 mel frames per second, 4 frames per token).
The rounding is re-implemented here because ``balancer/`` imports only numpy, numba and stdlib.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from omniscale.balancer.types import WindowSamples
from omniscale.media import MEDIA_KINDS

MAX_TOKENS = 131072
PATCH = 14
FACTOR = 28  # patch 14 × spatial merge 2
MERGE = 4  # 2×2 patches -> one LLM token
IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 1280 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28  # per frame: videos are sampled at lower resolution
VIDEO_FPS = 2.0
AUDIO_FRAMES_PER_S = 100
AUDIO_FRAMES_PER_TOKEN = 4

OMNI_SOURCES = ("text", "image", "multi_image", "video", "audio")
OMNI_SHARES = (0.30, 0.55, 0.05, 0.07, 0.03)
IMAGE, VIDEO, AUDIO = (MEDIA_KINDS.index(k) for k in ("image", "video", "audio"))


def lognormal_lengths(n: int, rng: np.random.Generator, mean: float = 7.5,
                      sigma: float = 1.5) -> np.ndarray:
    """``n`` int64 lengths from lognormal(mean, sigma), rounded, clipped to [1, MAX_TOKENS]."""
    return np.clip(np.rint(rng.lognormal(mean, sigma, n)), 1, MAX_TOKENS).astype(np.int64)


def exact_counts(n: int, shares: tuple[float, ...]) -> np.ndarray:
    """Per-category counts summing to ``n``, each within 1 of ``n·share`` (largest remainder)."""
    raw = np.asarray(shares, np.float64) / sum(shares) * n
    counts = np.floor(raw).astype(np.int64)
    counts[np.argsort(-(raw - counts), kind="stable")[: n - counts.sum()]] += 1
    return counts


def smart_resize(h_K: np.ndarray, w_K: np.ndarray, min_pixels: int,
                 max_pixels: int) -> tuple[np.ndarray, np.ndarray]:
    """Sides rounded to multiples of FACTOR with area in [min_pixels, max_pixels], aspect kept.

    The vectorised equivalent of ``omniscale.geometry.smart_resize`` for the factor used here.
    """
    h_K = h_K.astype(np.float64)
    w_K = w_K.astype(np.float64)
    rh_K = np.maximum(FACTOR, np.rint(h_K / FACTOR) * FACTOR)
    rw_K = np.maximum(FACTOR, np.rint(w_K / FACTOR) * FACTOR)
    big_K = rh_K * rw_K > max_pixels
    small_K = rh_K * rw_K < min_pixels
    down_K = np.sqrt(h_K * w_K / max_pixels)
    up_K = np.sqrt(min_pixels / (h_K * w_K))
    rh_K = np.where(big_K, np.maximum(FACTOR, np.floor(h_K / down_K / FACTOR) * FACTOR), rh_K)
    rw_K = np.where(big_K, np.maximum(FACTOR, np.floor(w_K / down_K / FACTOR) * FACTOR), rw_K)
    rh_K = np.where(small_K, np.ceil(h_K * up_K / FACTOR) * FACTOR, rh_K)
    rw_K = np.where(small_K, np.ceil(w_K * up_K / FACTOR) * FACTOR, rw_K)
    return rh_K.astype(np.int64), rw_K.astype(np.int64)


def image_patches(k: int, rng: np.random.Generator) -> np.ndarray:
    """Patches of ``k`` images with sides uniform in 224..2048 px after the resize rounding."""
    h_K, w_K = smart_resize(rng.integers(224, 2049, k), rng.integers(224, 2049, k),
                            IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS)
    return (h_K // PATCH) * (w_K // PATCH)


def video_patches(k: int, rng: np.random.Generator) -> np.ndarray:
    """Patches (t·h·w) of ``k`` clips of 2..60 s at 2 fps, 360p..1080p, two frames per t."""
    frames_K = np.maximum(2, np.rint(rng.uniform(2.0, 60.0, k) * VIDEO_FPS)).astype(np.int64)
    frames_K += frames_K % 2
    heights = np.array([360, 480, 720, 1080])
    h_K = heights[rng.integers(0, len(heights), k)]
    h_K, w_K = smart_resize(h_K, h_K * 16 // 9, IMAGE_MIN_PIXELS, VIDEO_MAX_PIXELS)
    return frames_K // 2 * (h_K // PATCH) * (w_K // PATCH)


def audio_frames(k: int, rng: np.random.Generator) -> np.ndarray:
    """Mel frames of ``k`` clips of 1..30 s."""
    return np.rint(rng.uniform(1.0, 30.0, k) * AUDIO_FRAMES_PER_S).astype(np.int64)


def caption_tokens(k: int, rng: np.random.Generator) -> np.ndarray:
    """Short captions: about 30 tokens, 4..512."""
    return np.clip(np.rint(rng.lognormal(3.4, 0.6, k)), 4, 512).astype(np.int64)


def omni(n: int, rng: np.random.Generator) -> WindowSamples:
    """The omni mix: OMNI_SHARES of OMNI_SOURCES (exact counts, shuffled), source id = category.

    A sample's tokens are its text plus the LLM tokens of its items, clipped to MAX_TOKENS.
    """
    source_N = rng.permutation(np.repeat(np.arange(len(OMNI_SOURCES), dtype=np.int32),
                                         exact_counts(n, OMNI_SHARES)))
    counts = {name: np.flatnonzero(source_N == s) for s, name in enumerate(OMNI_SOURCES)}
    text_N = caption_tokens(n, rng)
    text_N[counts["text"]] = lognormal_lengths(len(counts["text"]), rng)
    items_N = np.zeros(n, np.int64)
    items_N[counts["image"]] = 1
    items_N[counts["multi_image"]] = rng.integers(2, 7, len(counts["multi_image"]))
    items_N[counts["video"]] = 1
    items_N[counts["audio"]] = 1
    offsets_N1 = np.concatenate([[0], np.cumsum(items_N)]).astype(np.int64)
    owner_M = np.repeat(np.arange(n), items_N)
    kind_M = np.full(len(owner_M), IMAGE, np.int8)
    kind_M[np.isin(owner_M, counts["video"])] = VIDEO
    kind_M[np.isin(owner_M, counts["audio"])] = AUDIO
    size_M = np.zeros(len(owner_M), np.int64)
    tokens_M = np.zeros(len(owner_M), np.int64)
    for kind, draw, per_token in ((IMAGE, image_patches, MERGE), (VIDEO, video_patches, MERGE),
                                  (AUDIO, audio_frames, AUDIO_FRAMES_PER_TOKEN)):
        mine_M = kind_M == kind
        size_M[mine_M] = draw(int(mine_M.sum()), rng)
        tokens_M[mine_M] = np.maximum(1, size_M[mine_M] // per_token)
    media_N = np.bincount(owner_M, weights=tokens_M, minlength=n).astype(np.int64)
    return WindowSamples(
        tokens_N=np.minimum(text_N + media_N, MAX_TOKENS), source_N=source_N,
        batch_N=np.zeros(n, np.int32), item_offsets_N1=offsets_N1, item_size_M=size_M,
        item_kind_M=kind_M, item_tokens_M=tokens_M)


def lognormal(n: int, rng: np.random.Generator) -> WindowSamples:
    """Text only, lognormal(7.5, 1.5) lengths clipped to [1, 131072]."""
    return WindowSamples.from_lengths(lognormal_lengths(n, rng))


def uniform(n: int, rng: np.random.Generator) -> WindowSamples:
    """Text only, lengths uniform in 64..4096: an easy case where every policy does well."""
    return WindowSamples.from_lengths(rng.integers(64, 4097, n))


def bimodal(n: int, rng: np.random.Generator) -> WindowSamples:
    """Text only: 95% short (128..1024), 5% long (32K..64K), two sources by mode."""
    long_N = rng.random(n) < 0.05
    tokens_N = np.where(long_N, rng.integers(32768, 65537, n), rng.integers(128, 1025, n))
    return WindowSamples.from_lengths(tokens_N, source_N=long_N.astype(np.int32))


DISTRIBUTIONS = MappingProxyType({
    "lognormal": lognormal, "omni": omni, "uniform": uniform, "bimodal": bimodal})


def generate(name: str, n: int, seed: int) -> WindowSamples:
    """``n`` samples of the named distribution; KeyError for an unknown name."""
    return DISTRIBUTIONS[name](n, np.random.default_rng(seed))
