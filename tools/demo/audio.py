"""The ``audio_caption`` source: a short motif of pure tones, repeated, as WAV or FLAC.

Members: ``KEY.wav`` or ``KEY.flac`` (PCM_16 at 16, 22.05 or 44.1 kHz), ``KEY.txt`` (``slow
tones: C4 E4 G4.``), ``KEY.json`` (notes, frequencies, rhythm, sample rate, seconds, format).
Durations are long-tailed in [1, 30] s (log-normal around 4 s), like real clip collections.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import soundfile as sf

from omniscale.tools.demo import scenes

NOTE_NAMES = ("C", "D", "E", "F", "G", "A", "B")
SEMITONES = {"C": -9, "D": -7, "E": -5, "F": -4, "G": -2, "A": 0, "B": 2}  # from A in octave
OCTAVES = (3, 4, 5)
SAMPLE_RATES = (16_000, 22_050, 44_100)
RHYTHMS = {"slow": (0.6, 0.15), "fast": (0.2, 0.05)}  # (tone, silence) seconds
MIN_SECONDS, MAX_SECONDS = 1.0, 30.0
RAMP_SECONDS = 0.01  # fade in/out per tone so the onsets do not click


def frequency(note: str) -> float:
    """Equal temperament, A4 = 440 Hz: ``C4`` -> 261.63."""
    name, octave = note[:-1], int(note[-1])
    return 440.0 * 2.0 ** ((SEMITONES[name] + 12 * (octave - 4)) / 12)


def caption(labels: dict) -> str:
    return f"{labels['rhythm']} tones: {' '.join(labels['notes'])}."


def synthesize(notes: list[str], rhythm: str, sample_rate: int, n_samples: int) -> np.ndarray:
    """The motif (tone, silence per note) repeated and cut to ``n_samples``; float32 mono."""
    tone_s, gap_s = RHYTHMS[rhythm]
    n_tone, n_gap = int(tone_s * sample_rate), int(gap_s * sample_rate)
    t = np.arange(n_tone, dtype=np.float64) / sample_rate
    ramp = np.minimum(1.0, np.minimum(t, tone_s - t) / RAMP_SECONDS)
    period = []
    for note in notes:
        f = frequency(note)
        wave = np.sin(2 * np.pi * f * t) + 0.3 * np.sin(4 * np.pi * f * t)
        period += [0.35 * ramp * wave, np.zeros(n_gap)]
    period = np.concatenate(period)
    reps = -(-n_samples // len(period))
    return np.tile(period, reps)[:n_samples].astype(np.float32)


def render(rng: np.random.Generator) -> tuple[dict, str, bytes]:
    """A random clip: (labels, extension, encoded bytes)."""
    n_notes = int(rng.integers(2, 5))
    notes = [f"{scenes.pick(rng, NOTE_NAMES)}{scenes.pick(rng, OCTAVES)}" for _ in range(n_notes)]
    rhythm = scenes.pick(rng, RHYTHMS)
    sample_rate = SAMPLE_RATES[int(rng.integers(len(SAMPLE_RATES)))]
    seconds = math.exp(rng.normal(math.log(4.0), 0.9))
    seconds = round(min(MAX_SECONDS, max(MIN_SECONDS, seconds)), 2)
    ext = "flac" if rng.random() < 0.5 else "wav"
    audio = synthesize(notes, rhythm, sample_rate, int(round(seconds * sample_rate)))
    buf = io.BytesIO()
    sf.write(buf, audio, sample_rate, format=ext.upper(), subtype="PCM_16")
    labels = {"notes": notes, "frequencies": [round(frequency(n), 2) for n in notes],
              "rhythm": rhythm, "sample_rate": sample_rate, "seconds": seconds, "format": ext}
    return labels, ext, buf.getvalue()


def sample(rng: np.random.Generator) -> tuple[list[tuple[str, bytes]], list[str]]:
    """Members (suffix, bytes) of one audio-caption sample, and its text for the tokenizer."""
    labels, ext, data = render(rng)
    text = caption(labels)
    members = [(ext, data), ("txt", text.encode()),
               ("json", json.dumps(labels, sort_keys=True).encode())]
    return members, [text]
