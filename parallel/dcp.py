"""Distributed checkpoints of model and optimizer state that load on any mesh.

`torch.distributed.checkpoint` writes each rank's shards with their global placement, and
`get_state_dict` / `set_state_dict` give FSDP/TP/EP models and their optimizers state dicts
keyed by plain parameter names (no FSDP or activation-checkpoint prefixes). A checkpoint saved
by 4 ranks therefore loads on 2 (or 8, or 1), under any FSDP, TP, HSDP or AC layout of the same
model: each rank reads just the slices its own shards cover.

`extra` holds small tensor-valued trainer state (step counter, RNG offsets): tensors only, so
nothing is pickled and loading never needs `torch.load` beyond weights.

Expert parallelism keeps each rank's slice of the experts as a plain tensor (FSDP then shards
it over `edp_shard`), which DCP would save as E/ep experts under one name from every ep rank.
The checkpoint therefore presents each EP-sharded expert weight (and its optimizer state) as
one DTensor over all E experts on the expert mesh: sharded over `ep` first (contiguous blocks
of experts, as `apply_ep` deals them), then over `edp_shard` within a block (FSDP's shard),
which DTensor spells `_StridedShard` on `edp_shard` (the right-to-left order FSDP+TP uses).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

# Optimizer state flattened to one key per parameter and field ("state.<fqn>.exp_avg",
# "param_groups.<fqn>.lr"): pipeline stages hold different parameters, and the nested form's
# one "param_groups" list (written by one rank) would not fit the others (torchtitan's choice).
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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
        model_sd, optim_sd = get_state_dict(self.model, optimizers, options=OPTIONS)
        state = {"model": model_sd, "extra": dict(self.extra)}
        if self.optimizer is not None:
            state["optimizer"] = optim_sd
        self._ep_originals = _globalize_experts(self.model, state)
        return state

    def load_state_dict(self, state: dict) -> None:
        for where, key, original in self._ep_originals:  # back to the model's layout
            with torch.no_grad():
                _local(original).copy_(where[key].to_local())
            where[key] = original
        optimizers = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(self.model, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state.get("optimizer", {}), options=OPTIONS)
        for key, value in state["extra"].items():
            self.extra[key].copy_(value)


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def plain_name(name: str) -> str:
    """A module's name as state dicts spell it (no activation-checkpoint / compile prefixes)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _globalize_experts(model: nn.Module, state: dict) -> list:
    """Replace, in `state`, every EP-sharded expert weight and its optimizer state by a DTensor
    over all experts (module docstring); returns (dict, key, the replaced tensor) of each."""
    originals = {}
    for name, module in model.named_modules():
        global_experts = getattr(module, "num_global_experts", None)
        if global_experts is None:
            continue
        for param_name in ("gate_up_proj", "down_proj"):
            fqn = f"{plain_name(name)}.{param_name}"
            places = [(state["model"], fqn)]
            optim = state.get("optimizer", {})
            places += [(optim, k) for k, v in optim.items() if k.startswith(f"state.{fqn}.")
                       and isinstance(v, torch.Tensor) and v.dim() == 3]
            for where, key in places:
                originals[(id(where), key)] = (where, key, where[key])
                where[key] = _expert_dtensor(where[key], module, global_experts)
    return list(originals.values())


def _expert_dtensor(tensor: torch.Tensor, experts: nn.Module, global_experts: int):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ep_mesh = getattr(experts, "ep_mesh", None)
    if ep_mesh is None:
        raise ValueError("checkpoint: expert-parallel experts need apply_ep(model, "
                         "expert_mesh['ep']) (a DeviceMesh, not a process group) to be saved")
    root, ep = ep_mesh._get_root_mesh(), ep_mesh.size()
    if isinstance(tensor, DTensor):  # FSDP-sharded over edp_shard (HSDP: and replicated)
        names = tuple(tensor.device_mesh.mesh_dim_names) + ("ep",)
        placements = [Replicate() if isinstance(p, Replicate) else _StridedShard(0, split_factor=ep)
                      for p in tensor.placements] + [Shard(0)]
        local = tensor.to_local()
    else:
        names, placements, local = ("ep",), [Shard(0)], tensor
    shape = torch.Size((global_experts, *local.shape[1:]))
    return DTensor.from_local(local.detach(), root[names], placements, run_check=False,
                              shape=shape, stride=torch.empty(shape, device="meta").stride())


def save(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write a checkpoint to directory `path`; every rank of the default group calls it."""
    dcp.save({"train": TrainState(model, optimizer, extra)}, checkpoint_id=str(path))


def async_save(path: str | Path, model: nn.Module,
               optimizer: torch.optim.Optimizer | None = None,
               extra: dict[str, torch.Tensor] | None = None, process_group=None):
    """Like `save`, but returns once the state is copied to host memory; a background thread
    writes the files. Returns a future: the checkpoint is complete once `.result()` returns.
    `process_group`: a group of its own for the writer thread's coordination (collectives of
    two threads on one group would interleave); every rank calls this."""
    return dcp.async_save({"train": TrainState(model, optimizer, extra)},
                          checkpoint_id=str(path), process_group=process_group)


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict[str, torch.Tensor] | None = None) -> None:
    """Load `path` into `model`, `optimizer` and the tensors of `extra` in place, whatever
    mesh saved it. The model must already be parallelised (shards are read into its layout);
    an optimizer with no state yet is initialised first, so its state can be filled."""
    dcp.load({"train": TrainState(model, optimizer, extra)}, checkpoint_id=str(path))
