"""Per-step metrics: one JSON line per step in ``RUN_DIR/metrics.jsonl`` (rank 0), the same
numbers as TensorBoard scalars in ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``;
dicts such as ``source_loss`` become ``source_loss/<source>``) and, with ``metrics.wandb``, in
Weights & Biases (``tools.train.trackers``), and the progress line.

The step-time model (``cost_model.CostFit``): the plan predicts each rank's cost (the
balancer's units); the trainer measures each rank's compute seconds. ``sec_per_cost`` is fitted
online (least squares through the origin over the steps so far), so ``predicted_step_s`` for
step s uses only steps < s.
"""

from __future__ import annotations

import json
from pathlib import Path

from omniscale.tools.train.trackers import TensorBoardSink, WandbSink


class MetricsWriter:
    """Appends rows to metrics.jsonl and hands each to the sinks (TensorBoard; W&B with
    ``metrics.wandb``: ``tools.train.trackers``). On resume, rows at or after the resumed step
    are dropped first so the file reads as one run."""

    def __init__(self, path: Path, resume_step: int | None = None, wandb=None,
                 config: dict | None = None) -> None:
        self.path = path
        self.tokens_before = 0  # tokens trained by the rows kept (a resumed run's past)
        if resume_step is not None and path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", -1) < resume_step]
            path.write_text("".join(line + "\n" for line in keep))
            self.tokens_before = sum(json.loads(line).get("tokens", 0) for line in keep)
        self.sinks = [TensorBoardSink(path.parent / "tensorboard")]
        if wandb is not None:  # metrics.wandb
            self.sinks.append(WandbSink(wandb, path.parent, config,
                                        resumed=bool(resume_step)))
        self.file = path.open("a")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        self.file.close()
        for sink in self.sinks:
            sink.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Progress:
    """Rank 0's progress: a rich bar with ETA on a terminal; otherwise (``--no-progress``, a log
    file, a pipe) one plain line every ``every`` steps, ``step N/TOTAL  ...  eta``, flushed at
    once so a supervisor (or a test) can follow the run. Other ranks: silent."""

    def __init__(self, rank0: bool, bar: bool, total: int, start: int, every: int = 1) -> None:
        import sys
        import time

        self.bar, self.enabled, self.total, self.done, self.every = None, rank0, total, start, every
        self.start_done, self.t0, self.clock = start, time.monotonic(), time.monotonic
        if not rank0 or not bar or not sys.stdout.isatty():
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self.bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                       TextColumn("eta"), TimeRemainingColumn(), transient=False)
        self.task = self.bar.add_task("train", total=total, completed=start, info="")
        self.bar.start()

    def update(self, info: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)
        elif self.enabled and (self.done % self.every == 0 or self.done == self.total):
            rate = (self.done - self.start_done) / max(self.clock() - self.t0, 1e-9)
            eta = (self.total - self.done) / max(rate, 1e-9)
            print(f"step {self.done}/{self.total}  {info}  "
                  f"eta {int(eta) // 60}m{int(eta) % 60:02d}s",
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
