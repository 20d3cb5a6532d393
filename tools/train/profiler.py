"""``profile.steps: [first, last]``: torch.profiler over training steps first..last (inclusive),
one Chrome trace per rank in ``RUN_DIR/profile/trace-rankR-steps-A-B.json`` (open it in
https://ui.perfetto.dev or chrome://tracing). ``ProfilerStep#N`` in the trace is training step
N, so a trace reads against metrics.jsonl's rows, a resumed run's too.

The loop makes one with :func:`step_profiler` before its first step, calls :meth:`step` after
each step and :meth:`close` at the end (also on an error: a window already entered is written,
as far as it got).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile


class StepProfiler:
    def __init__(self, first: int, last: int, run_dir: Path, rank: int, device: torch.device,
                 start_step: int = 0) -> None:
        self.first, self.last, self.rank, self.device = first, last, rank, device
        self.out = Path(run_dir) / "profile"
        self.start_step = start_step
        self.next_step = start_step  # the step about to run
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        else:  # a CUDA build on a machine without a GPU: kineto's "gpuGetDeviceCount failed"
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # (read when the profiler starts)
        # Shapes and stacks stay off: they multiply a trace's size for what a timeline shows.
        # acc_events: one window is one cycle anyway, and torch warns without it
        self.prof = profile(activities=activities, schedule=self._action,
                            on_trace_ready=self._write, acc_events=True)
        # The profiler counts its steps from 0; a resumed run starts at start_step, and the
        # schedule and the ProfilerStep#N markers are to be in training steps.
        self.prof.step_num = start_step
        self.prof.current_action = self._action(start_step)
        self.prof.start()

    def _action(self, step: int) -> ProfilerAction:
        if step == self.first - 1:  # one step's warm-up keeps the profiler's start-up out
            return ProfilerAction.WARMUP
        if self.first <= step < self.last:
            return ProfilerAction.RECORD
        if step == self.last:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    def step(self, step: int) -> None:
        """Step ``step`` has finished."""
        if self.prof is None:
            return
        if step == self.last and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's last kernels into the trace
        self.next_step = step + 1
        self.prof.step()
        if step >= self.last:  # the trace is written: nothing more to record, no more cost
            self.close()

    def close(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)  # stops; a window entered is written (_write)

    def _write(self, prof: profile) -> None:
        first = max(self.first, self.start_step)
        last = min(self.last, self.next_step)  # an error inside the window: as far as it got
        path = self.out / f"trace-rank{self.rank}-steps-{first}-{last}.json"
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
        except OSError as e:  # a diagnostic: the run goes on without it
            warnings.warn(f"profile: could not write {path}: {e}", stacklevel=2)


def step_profiler(cfg, run_dir: Path, rank: int, device: torch.device,
                  start_step: int) -> StepProfiler | None:
    """The rank's profiler, or None when ``profile.steps`` is unset or already behind the
    run (a resumed run that starts after ``last``)."""
    if cfg.profile.steps is None:
        return None
    first, last = cfg.profile.steps
    if start_step > last:
        return None
    return StepProfiler(first, last, run_dir, rank, device, start_step)
