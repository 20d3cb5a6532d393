"""A stream of samples cut into global batches (steps), and the windows a planner sees.

The stream is one :class:`WindowSamples` holding every sample in arrival order; the steps are
``step_offsets_S1`` (step s draws samples ``[off[s], off[s+1])``), so slicing is cheap and the
global sample index of a window-local one is just the window's first sample plus it.
"""

from __future__ import annotations

import numpy as np

from omniscale.balancer.types import WindowSamples


def steps_by_count(num_samples: int, per_step: int, max_steps: int | None = None) -> np.ndarray:
    """Step offsets for ``per_step`` samples a step: as many full steps as the stream holds."""
    if per_step < 1:
        raise ValueError(f"per_step: must be >= 1, got {per_step}")
    steps = num_samples // per_step
    if max_steps is not None:
        steps = min(steps, max_steps)
    return np.arange(steps + 1, dtype=np.int64) * per_step


def steps_by_tokens(tokens_N: np.ndarray, budget: int, max_steps: int | None = None) -> np.ndarray:
    """Step offsets for greedy global batches of at most ``budget`` tokens.

    A step takes samples in order until the next one would exceed the budget (a sample longer
    than the budget is a step of its own). The trailing step is dropped unless the next sample
    would have closed it, the way a drop-last sampler drops a partial batch.
    """
    if budget < 1:
        raise ValueError(f"budget: must be >= 1, got {budget}")
    offsets = [0]
    total = 0
    for i, t in enumerate(np.asarray(tokens_N).tolist()):
        if total and total + t > budget:
            offsets.append(i)
            total = 0
            if max_steps is not None and len(offsets) > max_steps:
                break
        total += t
    return np.asarray(offsets, np.int64)


def take(stream: WindowSamples, lo: int, hi: int,
         batch_N: np.ndarray | None = None) -> WindowSamples:
    """Samples ``[lo, hi)`` of the stream with their items, re-offset to start at 0."""
    ilo, ihi = int(stream.item_offsets_N1[lo]), int(stream.item_offsets_N1[hi])
    return WindowSamples(
        tokens_N=stream.tokens_N[lo:hi], source_N=stream.source_N[lo:hi],
        batch_N=np.zeros(hi - lo, np.int32) if batch_N is None else np.asarray(batch_N, np.int32),
        item_offsets_N1=stream.item_offsets_N1[lo:hi + 1] - ilo,
        item_size_M=stream.item_size_M[ilo:ihi], item_kind_M=stream.item_kind_M[ilo:ihi],
        item_tokens_M=stream.item_tokens_M[ilo:ihi])


def windows(step_offsets_S1: np.ndarray, window: int) -> list[tuple[int, int]]:
    """(first step, end step) of each window of ``window`` consecutive steps; the last may be
    short."""
    steps = len(step_offsets_S1) - 1
    return [(s, min(s + window, steps)) for s in range(0, steps, window)]


def window_samples(stream: WindowSamples, step_offsets_S1: np.ndarray, first: int,
                   end: int) -> WindowSamples:
    """Steps ``[first, end)`` as one window: ``batch_N`` is the step within the window."""
    lo, hi = int(step_offsets_S1[first]), int(step_offsets_S1[end])
    batch_N = np.repeat(np.arange(end - first, dtype=np.int32),
                        np.diff(step_offsets_S1[first:end + 1]))
    return take(stream, lo, hi, batch_N)


def arrival_step(step_offsets_S1: np.ndarray) -> np.ndarray:
    """The step each planned sample was drawn for (int64 [N] over the planned prefix)."""
    return np.repeat(np.arange(len(step_offsets_S1) - 1, dtype=np.int64), np.diff(step_offsets_S1))


def llm_costs(samples: WindowSamples, costs) -> np.ndarray:
    """Predicted LLM cost of each sample run whole on one rank (float64 [N])."""
    return np.asarray(costs.llm(samples.tokens_N), np.float64)


def item_costs(samples: WindowSamples, costs) -> np.ndarray:
    """Predicted encoder cost of each item under its kind's cost model (float64 [M])."""
    return costs.item_cost(samples.item_size_M, samples.item_kind_M)
