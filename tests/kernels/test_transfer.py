"""Host → device copies (kernels/transfer.py): the values arrive, and on CPU nothing changes."""

from __future__ import annotations

import pytest
import torch

from omniscale.kernels.transfer import host_to_device, to_device


def test_values_and_dtype_arrive():
    assert to_device([1, 2, 3], "cpu", torch.int32).tolist() == [1, 2, 3]
    assert to_device([1, 2, 3], "cpu", torch.int32).dtype == torch.int32
    x = torch.arange(4)
    assert host_to_device(x, torch.device("cpu")) is x  # on its device already: no copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copies_to_cuda_from_pageable_pinned_and_device_tensors():
    x = torch.arange(1000)
    for source in (x, x.pin_memory(), x.cuda()):
        out = host_to_device(source, "cuda")
        assert out.is_cuda and torch.equal(out.cpu(), x)
