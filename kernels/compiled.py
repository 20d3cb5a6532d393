"""torch.compile'd references for CPU, for the ops where tools/bench/kernel_ops.py measured
compile beating eager forward+backward (README, Kernels): the reference's several elementwise
passes fuse into one loop. Same signatures as kernels/reference.py; each op compiles once per
process on first call (and again for new shapes, dynamically after the first change).
"""

from __future__ import annotations

import functools

import torch

from omniscale.kernels import reference


@functools.cache
def _compiled(op: str):
    return torch.compile(getattr(reference, op))


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return _compiled("rms_norm")(x_TD, weight_D, eps)


def add_rms_norm(x_TD: torch.Tensor, residual_TD: torch.Tensor, weight_D: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    return _compiled("add_rms_norm")(x_TD, residual_TD, weight_D, eps)


def rotary(x_THK: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    return _compiled("rotary")(x_THK, cos_TK, sin_TK)


def swiglu(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    return _compiled("swiglu")(gate_TF, up_TF)


def moe_unpermute(y_PD: torch.Tensor, order_P: torch.Tensor, weight_TK: torch.Tensor
                  ) -> torch.Tensor:
    return _compiled("moe_unpermute")(y_PD, order_P, weight_TK)
