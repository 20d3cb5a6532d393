"""Gradient clipping across meshes (`parallel.grads.clip_grad_norm`) against torch's own
`clip_grad_norm_` on the unsharded model: the omni model with its encoders on their own
encoder mesh, FSDP over 2 gloo ranks, so the clipped gradients span two meshes."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.multiproc import run_ranks

CLIP = 1e-3  # far below the gradients' norm: every gradient is scaled


def _model():
    from omniscale.backbone.config import ModelConfig
    from omniscale.backbone.omni import OmniModel
    from omniscale.encoders.audio import AudioConfig
    from omniscale.encoders.vision import VisionConfig

    torch.manual_seed(0)
    return OmniModel(ModelConfig.preset("tiny", n_layers=2, vocab_size=256,
                                        vision=VisionConfig.preset("tiny"),
                                        audio=AudioConfig.preset("tiny")))


def _fill_grads(model) -> None:
    """Seeded gradients of every parameter's full shape (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    for _, p in sorted(model.named_parameters()):
        full = torch.randn(p.shape, generator=g)
        local = full
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = local


def _clipped(rank, world):
    from omniscale.parallel import ParallelDims, apply_fsdp
    from omniscale.parallel.grads import clip_grad_norm

    dims = ParallelDims(world_size=world)
    model = apply_fsdp(_model(), dims.build_mesh("cpu"),
                       encoder_mesh=dims.build_encoder_mesh("cpu"))
    _fill_grads(model)
    norm = clip_grad_norm(model, CLIP)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
             for n, p in model.named_parameters()}
    return float(norm), grads


def test_clipping_over_two_meshes_matches_torch_on_the_whole_model():
    reference = _model()
    _fill_grads(reference)
    want = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP, foreach=False))
    for norm, grads in run_ranks(_clipped, 2):
        assert abs(norm - want) <= 1e-5 * want
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-9,
                                       msg=lambda m, n=name: f"{n}: {m}")


IMPLEMENTATIONS = {"loop": {"foreach": False}, "foreach": {"foreach": True},
                   "fused": {"fused": True}}


def _adam_steps(rank, world, how):
    """Two AdamW steps of the omni model FSDP-sharded over its two meshes."""
    from omniscale.parallel import ParallelDims, apply_fsdp

    dims = ParallelDims(world_size=world)
    model = apply_fsdp(_model(), dims.build_mesh("cpu"),
                       encoder_mesh=dims.build_encoder_mesh("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **IMPLEMENTATIONS[how])
    for _ in range(2):
        _fill_grads(model)
        optimizer.step()
    return {n: p.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["fused", "foreach"])
def test_fused_and_foreach_adamw_over_two_meshes_equal_the_per_tensor_loop(how):
    """What the trainer's optimizer does (fused, tools/train/build.py) and torch's GPU default
    (foreach) against the per-tensor loop, over DTensors of two meshes."""
    loop, other = run_ranks(_adam_steps, 2, "loop")[0], run_ranks(_adam_steps, 2, how)[0]
    assert loop.keys() == other.keys()
    for name, p in loop.items():
        torch.testing.assert_close(other[name], p, rtol=1e-6, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
