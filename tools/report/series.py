"""Reading a run's metric rows into arrays for the report's figures: each field defensively --
missing, null or of the wrong type in a row counts as "not recorded at that step" -- and long
runs binned for heatmaps."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import numpy as np

from omniscale.tools.report.inputs import is_number

MAX_HEATMAP_COLUMNS = 1500  # longer runs are averaged into bins: a pixel per step is no use


# -- reading fields ----------------------------------------------------------------------------
def scalar_series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows where ``key`` holds a number."""
    pairs = [(r["step"], r[key]) for r in rows if is_number(r.get(key))]
    if not pairs:
        return np.empty(0), np.empty(0)
    steps, values = zip(*pairs)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def vector_series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, matrix steps × items) of the rows where ``key`` is a list of numbers; rows
    of different lengths (a resume on another rank count) are padded with NaN."""
    steps, lists = [], []
    for r in rows:
        value = r.get(key)
        if isinstance(value, list) and value:
            steps.append(r["step"])
            lists.append(value)
    if not lists:
        return np.empty(0), np.empty((0, 0))
    return np.asarray(steps, dtype=float), padded(lists)


def dict_series(rows: list[dict], key: str) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(steps, names, matrix steps × names) of the rows where ``key`` is {name: number};
    a name absent from a row is NaN there."""
    picked = [r for r in rows if isinstance(r.get(key), dict) and r[key]]
    names: list[str] = []
    for r in picked:
        names += [str(n) for n in r[key] if str(n) not in names]
    matrix = np.full((len(picked), len(names)), np.nan)
    for i, r in enumerate(picked):
        for name, value in r[key].items():
            if is_number(value):
                matrix[i, names.index(str(name))] = value
    return np.asarray([r["step"] for r in picked], dtype=float), names, matrix


def smoothed(values: np.ndarray) -> np.ndarray:
    """Centred moving average over ~1/25 of the run, so the trend shows at any length and,
    unlike a trailing average, does not lag behind a falling loss. Non-finite values are left
    out of every window; windows shrink at the ends."""
    half = int(np.clip(len(values) / 50, 0, 500))
    finite = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    index = np.arange(len(values))
    lo, hi = np.maximum(index - half, 0), np.minimum(index + half + 1, len(values))
    n = counts[hi] - counts[lo]
    return np.where(n > 0, (sums[hi] - sums[lo]) / np.maximum(n, 1), np.nan)


@contextmanager
def quiet_nan():
    """All-NaN rows and zero means are expected here (a step that lacks a field, an idle rank):
    they give NaN, which plots as a gap, without a warning per occurrence."""
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def padded(lists: list[list]) -> np.ndarray:
    """Lists of numbers (other values: NaN) as one matrix, short lists padded with NaN."""
    matrix = np.full((len(lists), max((len(v) for v in lists), default=0)), np.nan)
    for i, values in enumerate(lists):
        matrix[i, :len(values)] = [v if is_number(v) else np.nan for v in values]
    return matrix


def per_step_mean_ratio(matrix: np.ndarray) -> np.ndarray:
    """Each row divided by its mean: load relative to the step's mean, comparable across steps."""
    with quiet_nan():
        mean = np.nanmean(np.where(np.isfinite(matrix), matrix, np.nan), axis=1, keepdims=True)
        return matrix / np.where(mean > 0, mean, np.nan)


def on_step_grid(steps: np.ndarray, matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows placed at their (integer) step, so a heatmap's columns line up with the steps of
    the line plots below it: a step that lacks the field stays a blank column instead of
    shifting every later one. Steps that are not integers, or too sparse to spread out,
    are left as they are."""
    if not len(steps) or not np.all(steps == np.round(steps)):
        return steps, matrix
    first, last = int(steps.min()), int(steps.max())
    if last - first + 1 > 20 * len(steps):
        return steps, matrix
    grid = np.full((last - first + 1, matrix.shape[1]), np.nan)
    grid[steps.astype(int) - first] = matrix
    return np.arange(first, last + 1, dtype=float), grid


def binned_columns(steps: np.ndarray, matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(steps, matrix, bin size) with at most MAX_HEATMAP_COLUMNS rows, each a bin's mean."""
    size = max(1, -(-len(steps) // MAX_HEATMAP_COLUMNS))
    if size == 1:
        return steps, matrix, 1
    n = len(steps) // size * size  # a ragged last bin is dropped: it would average fewer steps
    shaped = matrix[:n].reshape(n // size, size, matrix.shape[1])
    with quiet_nan():
        return steps[:n:size], np.nanmean(shaped, axis=1), size
