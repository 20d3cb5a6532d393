"""Triton rotary embedding against the torch reference, forward and backward, with 1-D RoPE
tables and multimodal (M-RoPE) tables: on CPU in Triton's interpreter (fp32; head dims whose
half is not a power of two, a non-contiguous input), and on CUDA in bf16 (gpu).

Tolerances, relative to the largest reference value: fp32 1e-5; bf16 2e-2."""

from __future__ import annotations

import pytest
import torch

from omniscale.kernels import reference, triton_rotary

pytestmark = pytest.mark.usefixtures("triton_env")


def near(got, want, tol):
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=tol * max(scale, 1.0), rtol=tol)


def tables(T, K, mrope, device="cpu"):
    pos = torch.arange(T, device=device)
    if not mrope:
        return reference.rotary_tables(pos, K)
    # image-like positions: time fixed, height/width on a grid; sections split K/2 in three
    pos3 = torch.stack([pos // 9, (pos // 3) % 3, pos % 3])
    half = K // 2
    sections = (half - 2 * (half // 3), half // 3, half // 3)
    return reference.rotary_tables(pos, K, mrope_position_3T=pos3, mrope_sections=sections)


def check(T, H, K, mrope, device="cpu", dtype=torch.float32, tol=1e-5, strided=False):
    torch.manual_seed(0)
    cos, sin = tables(T, K, mrope, device)
    if strided:  # q out of a fused qkv projection: a view with a row stride of 3·H·K
        qkv = torch.randn(T, 3 * H, K, device=device, dtype=dtype, requires_grad=True)
        x = qkv[:, :H]
    else:
        x = torch.randn(T, H, K, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(T, H, K, device=device, dtype=dtype)
    y = triton_rotary.rotary(x, cos, sin)
    y_ref = reference.rotary(x, cos, sin)
    near(y, y_ref, tol)
    leaf = qkv if strided else x
    near(torch.autograd.grad(y, leaf, dy)[0], torch.autograd.grad(y_ref, leaf, dy)[0], tol)


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("T,H,K", [(1, 1, 2), (5, 3, 12), (11, 4, 24)])
def test_rotary_matches_reference_in_interpreter(T, H, K, mrope):
    check(T, H, K, mrope)


def test_rotary_strided_input_and_empty():
    check(6, 2, 12, mrope=True, strided=True)
    check(0, 2, 8, mrope=False)


def test_rotary_odd_head_dim_is_an_error():
    cos, sin = reference.rotary_tables(torch.arange(3), 6)
    with pytest.raises(ValueError, match="head dim 5 must be even"):
        triton_rotary.rotary(torch.randn(3, 2, 5), cos[:, :5], sin[:, :5])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mrope", [False, True])
def test_rotary_matches_reference_on_cuda(mrope):
    check(4099, 16, 128, mrope, device="cuda", dtype=torch.bfloat16, tol=2e-2)
