"""Shared by the Triton kernel tests: the `gpu` marker and the interpreter environment.

The Triton tests run on CPU tensors in Triton's interpreter (kernels/triton_launch.py picks it
per launch). ``TRITON_INTERPRET=1`` is set only for the duration of each test that asks for
``triton_env`` (never for the session: other tests expect the registry's CPU choice to be the
reference), and the registry's resolution cache is cleared on both sides so no Triton choice
outlives the test. GPU tests run with the variable unset, on compiled kernels.
"""

from __future__ import annotations

import pytest

from omniscale.kernels.registry import _resolve


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (tools/bench/gpu_check.sh runs them)")


@pytest.fixture()
def triton_env(request, monkeypatch):
    if request.node.get_closest_marker("gpu"):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    _resolve.cache_clear()
    yield
    _resolve.cache_clear()
