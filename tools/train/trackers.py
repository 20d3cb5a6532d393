"""Where rank 0's metrics rows go besides ``metrics.jsonl``: TensorBoard (always) and Weights &
Biases (``metrics.wandb``, the optional ``wandb`` package). Every sink gets the same rows and
names a number alike (:func:`scalars`), so a curve is called the same everywhere.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from omniscale.errors import UserError

WANDB_ID_FILE = "wandb_id.txt"  # RUN_DIR's W&B run id: a resumed run continues that run


def scalars(row: dict) -> dict[str, float]:
    """A row's numbers by name: a dict field's numbers as ``field/key`` (``source_loss/text``);
    the step itself, flags, strings and lists are left out."""
    out = {}
    for name, value in row.items():
        if isinstance(value, dict):
            out.update({f"{name}/{key}": v for key, v in value.items() if _number(v)})
        elif _number(value) and name != "step":
            out[name] = value
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TensorBoardSink:
    """Scalars in ``log_dir`` (``tensorboard --logdir RUN_DIR``), opened with the first row."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.board = log_dir, None

    def write(self, row: dict) -> None:
        if self.board is None:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(self.log_dir))
        for name, value in scalars(row).items():
            self.board.add_scalar(name, value, row["step"])

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def require_wandb():
    """The wandb module, or one line saying how to install it (the launcher asks before any
    process starts)."""
    try:
        import wandb
    except ImportError:
        raise UserError("metrics.wandb: the wandb package is not installed "
                        "(pip install 'omniscale[wandb]')") from None
    return wandb


def check_trackers(cfg) -> None:
    if cfg.metrics.wandb is not None:
        require_wandb()


def wandb_run_id(run_dir: Path, resumed: bool) -> str:
    """The run directory's W&B id: kept by a resumed run, new for a run from step 0 (which
    starts metrics.jsonl afresh too)."""
    path = run_dir / WANDB_ID_FILE
    if resumed and path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)
    path.write_text(run_id + "\n")
    return run_id


class WandbSink:
    """One W&B run per run directory: ``wandb.init`` in ``RUN_DIR/wandb`` with the run's
    config; every row logged at its step."""

    def __init__(self, section, run_dir: Path, config: dict | None = None,
                 resumed: bool = False) -> None:
        wandb = require_wandb()
        run_dir = Path(run_dir)
        try:
            self.run = wandb.init(
                project=section.project, entity=section.entity,
                name=section.name or run_dir.resolve().name, group=section.group,
                tags=list(section.tags) or None, mode=section.mode, dir=str(run_dir),
                config=config, id=wandb_run_id(run_dir, resumed), resume="allow",
                # console="off": W&B does not wrap stdout/stderr (the progress bar's)
                settings=wandb.Settings(silent=True, console="off"))
        except Exception as e:  # a login, network or project error: W&B's own message
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"metrics.wandb: could not start the W&B run: {first}") from None

    def write(self, row: dict) -> None:
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()
