"""Distributed checkpoints of model and optimizer state that load on any mesh.

`torch.distributed.checkpoint` writes each rank's shards with their global placement, and
`get_state_dict` / `set_state_dict` give FSDP/TP/EP models and their optimizers state dicts
keyed by plain parameter names (no FSDP or activation-checkpoint prefixes). A checkpoint saved
by 4 ranks therefore loads on 2 (or 8, or 1), under any FSDP, TP, HSDP or AC layout of the same
model: each rank reads just the slices its own shards cover.

`extra` holds small tensor-valued trainer state (step counter, RNG offsets): tensors only, so
nothing is pickled and loading never needs `torch.load` beyond weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class TrainState(Stateful):
    """Model (+ optimizer, + extra tensors) as one DCP `Stateful`: DCP calls `state_dict`
    before saving and `load_state_dict` with the (resharded) values after loading."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict[str, torch.Tensor] | None = None):
        self.model, self.optimizer, self.extra = model, optimizer, extra or {}
        bad = [k for k, v in self.extra.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"checkpoint extra {bad}: values must be tensors")

    def state_dict(self) -> dict:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self.model, optimizers)
        state = {"model": model_sd, "extra": dict(self.extra)}
        if self.optimizer is not None:
            state["optimizer"] = optim_sd
        return state

    def load_state_dict(self, state: dict) -> None:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(self.model, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state.get("optimizer", {}))
        for key, value in state["extra"].items():
            self.extra[key].copy_(value)


def save(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write a checkpoint to directory `path`; every rank of the default group calls it."""
    dcp.save({"train": TrainState(model, optimizer, extra)}, checkpoint_id=str(path))


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict[str, torch.Tensor] | None = None) -> None:
    """Load `path` into `model`, `optimizer` and the tensors of `extra` in place, whatever
    mesh saved it. The model must already be parallelised (shards are read into its layout);
    an optimizer with no state yet is initialised first, so its state can be filled."""
    dcp.load({"train": TrainState(model, optimizer, extra)}, checkpoint_id=str(path))
