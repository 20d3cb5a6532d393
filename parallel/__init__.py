"""Parallelism applied from outside: named mesh, apply_* functions, collectives, checkpoints.

Order (torchtitan's): build `ParallelDims(...)` meshes, then on a plain model
`apply_pp` → `apply_tp` → `apply_ep` → `apply_sp` → `apply_ac` → `apply_fsdp`, each only
when its axis is > 1. Names are imported lazily, so `import parallel` stays cheap and a module
is loaded only when one of its names is used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ParallelDims": "mesh", "fsdp_mesh": "mesh",
    "apply_fsdp": "fsdp",
    "apply_tp": "tensor",
    "apply_ac": "checkpointing",
    "apply_ep": "expert",
    "apply_sp": "sequence",
    "apply_pp": "pipeline",
    "reshard": "reshard", "reshard_plan": "reshard",
    "save_checkpoint": ("dcp", "save"), "load_checkpoint": ("dcp", "load"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = target if isinstance(target, tuple) else (target, name)
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value
