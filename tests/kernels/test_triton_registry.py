"""How the Triton, compiled, chunked and eager backends are registered: Triton chosen on CPU
only in the interpreter (and on CUDA), chunked and eager the CPU defaults otherwise, importing
``kernels`` imports no Triton, ``describe`` lists the choice per op, and the CPU "compiled"
backend matches the reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omniscale import kernels
from omniscale.kernels import reference
from omniscale.kernels.triton_registry import COMPILED_OPS, TRITON_OPS

pytestmark = pytest.mark.usefixtures("triton_env")


def test_triton_chosen_in_interpreter_and_on_cuda(monkeypatch):
    for op in TRITON_OPS:
        assert kernels.backend_of(op, "cpu") == "triton"
        assert kernels.backend_of(op, "cpu", prefer="reference") == "reference"
    x, w = torch.randn(3, 5), torch.rand(5)
    torch.testing.assert_close(kernels.get("rms_norm", "cpu")(x, w), reference.rms_norm(x, w))
    monkeypatch.delenv("TRITON_INTERPRET")
    kernels.registry._resolve.cache_clear()
    # the CPU choices that are not the reference: plain torch, faster there
    cpu_defaults = {"linear_cross_entropy": "chunked", "rms_norm": "eager",
                    "add_rms_norm": "eager", "rotary": "eager", "moe_unpermute": "eager",
                    "varlen_attention": "blocked"}
    assert kernels.describe("cpu") == {op: cpu_defaults.get(op, "reference")
                                       for op in kernels.registry.CANDIDATES}
    described = kernels.describe("cuda")
    assert set(described) == set(kernels.registry.CANDIDATES)
    assert all(described[op] == "triton" for op in TRITON_OPS)


def test_importing_kernels_imports_no_triton():
    code = ("import sys; from omniscale import kernels; kernels.describe('cpu'); "
            "assert 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={"PATH": ""},
                   cwd=Path(__file__).resolve().parents[2])


def test_compiled_only_by_name_and_cpu_defaults_by_name_anywhere(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    kernels.registry._resolve.cache_clear()
    compiled = kernels.describe("cpu", prefer="compiled")
    assert {op for op, b in compiled.items() if b == "compiled"} == set(COMPILED_OPS)
    assert kernels.backend_of("linear_cross_entropy", "cpu", prefer="chunked") == "chunked"
    assert kernels.backend_of("linear_cross_entropy", "cuda", prefer="chunked") == "chunked"
    assert kernels.backend_of("rms_norm", "cuda", prefer="eager") == "eager"


@pytest.mark.slow  # one CPU torch.compile, forward and backward: ~15 s on 2 cores
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch's inductor
def test_compiled_backend_matches_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    kernels.registry._resolve.cache_clear()
    g, u = torch.randn(6, 10, requires_grad=True), torch.randn(6, 10, requires_grad=True)
    y = kernels.get("swiglu", "cpu", prefer="compiled")(g, u)
    y_ref = reference.swiglu(g, u)
    torch.testing.assert_close(y, y_ref)
    for got, want in zip(torch.autograd.grad(y.sum(), (g, u)),
                         torch.autograd.grad(y_ref.sum(), (g, u))):
        torch.testing.assert_close(got, want)
