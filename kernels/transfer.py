"""Host → device copies that never wait for the device.

A blocking copy to a GPU (``tensor.to("cuda")``, ``torch.tensor(data, device="cuda")``) waits
for every kernel queued before it: a host sync. ``non_blocking`` from pageable memory may still
be staged with a wait, so the copy goes through pinned memory (torch's caching host allocator
keeps the pinned blocks: no allocation per call after the first). Everything the step copies
from the host goes through here (``tools/train/step_audit.py`` counts what does not).
"""

from __future__ import annotations

import torch

HOST = torch.device("cpu")  # where a step keeps its bookkeeping (named, as every device is)


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``: from the host queued behind the device's work, not waiting
    for it; a tensor already there as it is."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def to_device(data, device: torch.device | str, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device`` without waiting for it."""
    return host_to_device(torch.tensor(data, dtype=dtype, device="cpu"), device)
