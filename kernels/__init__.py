"""Fused ops: a torch reference per op plus Triton / flash-attn versions, one registry.

``kernels.get("rms_norm", device)`` returns the implementation to call (see registry.py).
"""

from kernels.registry import backend_of, get, register

__all__ = ["get", "register", "backend_of"]
