"""Parallelism applied from outside: named mesh, apply_* functions, collectives, checkpoints.

Order (torchtitan's): build `ParallelDims(...)` meshes, then on a plain model
`apply_pp` → `apply_tp` → `apply_ep` → `apply_sp` → `apply_ac` → `apply_fsdp`, each only
when its axis is > 1. Names are imported lazily, so `import parallel` stays cheap and a module
is loaded only when one of its names is used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ParallelDims": "parallel.mesh", "fsdp_mesh": "parallel.mesh",
    "apply_fsdp": "parallel.fsdp",
    "apply_tp": "parallel.tensor",
    "apply_ac": "parallel.checkpointing",
    "apply_ep": "parallel.expert",
    "apply_sp": "parallel.sequence",
    "apply_pp": "parallel.pipeline",
    "reshard": "parallel.reshard", "reshard_plan": "parallel.reshard",
    "save_checkpoint": ("parallel.dcp", "save"), "load_checkpoint": ("parallel.dcp", "load"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'parallel' has no attribute {name!r}")
    module, attr = target if isinstance(target, tuple) else (target, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
