"""Device-aware ``triton.jit``: one kernel definition that compiles for CUDA tensors and runs in
Triton's interpreter for CPU tensors.

``triton.jit`` decides between compiling and interpreting once, when the module is imported,
from ``TRITON_INTERPRET``. That would make the test process's environment leak into every
later import (and a CUDA run in the same process would silently interpret). Here the choice is
made per launch from the tensors' device, so the CPU tests need no process-wide setting; the
registry still offers these kernels on CPU only under ``TRITON_INTERPRET=1`` (the interpreter is
for testing, far too slow to train with).

Triton's own library functions (``tl.sum``, ``tl.max``, ``tl.sigmoid``…) are themselves
``@triton.jit`` functions, compiled or interpreted by the same import-time switch; during an
interpreted launch their calls are routed to the interpreter (what ``TRITON_INTERPRET=1`` would
have made them), and restored afterwards.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_INTERPRETED: dict = {}  # python function -> its InterpretedFunction (a cache, never mutated state)


def _interpreted(fn) -> InterpretedFunction:
    if fn not in _INTERPRETED:
        _INTERPRETED[fn] = InterpretedFunction(fn)
    return _INTERPRETED[fn]


def _call_interpreted(self, *args, **kwargs):
    return _interpreted(self.fn)(*args, **kwargs)


def _run_interpreted(fn, grid, args, meta):
    saved = JITFunction.__call__
    JITFunction.__call__ = _call_interpreted
    try:
        return _interpreted(fn)[grid](*args, **meta)
    finally:
        JITFunction.__call__ = saved


class DeviceJIT:
    """``kernel[grid](*args, **meta)`` like a ``triton.jit`` kernel."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = None

    def __getitem__(self, grid):
        def launch(*args, **meta):
            on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args)
            if on_cpu or os.environ.get("TRITON_INTERPRET") == "1":
                return _run_interpreted(self.fn, grid, args, meta)
            if self._compiled is None:
                self._compiled = JITFunction(self.fn)
            return self._compiled[grid](*args, **meta)
        return launch


def jit(fn) -> DeviceJIT:
    return DeviceJIT(fn)


def block(n: int, cap: int = 1 << 16) -> int:
    """The power-of-two block covering ``n`` (Triton blocks are powers of two), at most cap."""
    return min(triton.next_power_of_2(max(int(n), 1)), cap)


def warps(block_elements: int) -> int:
    """Warps for a program that holds ``block_elements`` values (Liger's rule of thumb): enough
    threads that each keeps a few registers' worth. The interpreter ignores it."""
    return 32 if block_elements >= 32768 else 16 if block_elements >= 8192 else \
        8 if block_elements >= 2048 else 4
