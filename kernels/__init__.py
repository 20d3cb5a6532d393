"""Fused ops: a torch reference per op plus Triton / flash-attn versions, one registry.

``kernels.get("rms_norm", device)`` returns the implementation to call (see registry.py);
``kernels.describe(device)`` lists the backend chosen for every op.
"""

if __name__ == "kernels":  # the bare name: see hand_over_top_level
    from omniscale import hand_over_top_level

    hand_over_top_level(__name__)

import omniscale.kernels.triton_registry  # noqa: E402,F401  (registers Triton + compiled; imports no Triton)
from omniscale.kernels.registry import backend_of, describe, get, register

__all__ = ["get", "register", "backend_of", "describe"]
