"""DTensors never reach a raw-pointer Triton kernel: under tensor parallelism the q/k norms get
a head-sharded DTensor and a replicated DTensor weight, and on CUDA the registry's rms_norm is
Triton (kernels/dtensor.py).

On 2 gloo ranks, through the registry's choice for device "cuda" (Triton; its kernels run in
the interpreter on these CPU tensors), every launch is recorded: a split that keeps the normed
dim whole runs the kernel on the local shards, a split of the normed dim falls back to the
eager kernel, and no launch ever gets a DTensor. Values and gradients (weight: all-reduced)
match the torch reference on the unsplit tensors. The module path is parallel/tensor.py's own
plan (`HEAD_NORM` on an RMSNorm)."""

from __future__ import annotations

import os

import torch

from omniscale.kernels import reference
from tests.parallel.multiproc import run_ranks

T, H, K = 6, 4, 16


def data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(T, H, K, generator=g), "res": torch.randn(T, H, K, generator=g),
            "w": torch.rand(K, generator=g) + 0.5, "gy": torch.randn(T, H, K, generator=g),
            "gs": torch.randn(T, H, K, generator=g)}


def _spy_on_launches() -> list[list[str]]:
    """Every Triton launch from now on appends the type names of its tensor arguments."""
    from omniscale.kernels import triton_launch

    launches: list[list[str]] = []
    original = triton_launch.DeviceJIT.__getitem__

    def getitem(self, grid):
        launch = original(self, grid)

        def recorded(*args, **meta):
            launches.append([type(a).__name__ for a in args if isinstance(a, torch.Tensor)])
            return launch(*args, **meta)
        return recorded

    triton_launch.DeviceJIT.__getitem__ = getitem  # this rank's process only
    return launches


def _tp_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from omniscale import kernels
    from omniscale.backbone.norm import RMSNorm
    from omniscale.kernels.registry import _resolve
    from omniscale.parallel.tensor import HEAD_NORM

    os.environ["TRITON_INTERPRET"] = "1"  # for the module path: prefer="triton" on CPU
    _resolve.cache_clear()
    launches = _spy_on_launches()
    mesh = init_device_mesh("cpu", (world,))
    d = data()
    out: dict = {"backends": [kernels.backend_of(op, "cuda")
                              for op in ("rms_norm", "add_rms_norm")]}

    def split(t, placement, grad=False):
        return distribute_tensor(t, mesh, [placement]).requires_grad_(grad)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    rms_norm = kernels.get("rms_norm", "cuda")
    for name, placement in (("heads", Shard(1)), ("tokens", Shard(0)), ("normed", Shard(2))):
        start = len(launches)
        x, w = split(d["x"], placement, True), split(d["w"], Replicate(), True)
        y = rms_norm(x, w, 1e-6)
        y.backward(split(d["gy"], placement))
        out[name] = {"y": full(y), "dx": full(x.grad), "dw": full(w.grad),
                     "y_placements": y.placements, "launches": launches[start:]}

    add_rms_norm = kernels.get("add_rms_norm", "cuda")
    start = len(launches)
    x, res = split(d["x"], Shard(1), True), split(d["res"], Shard(1), True)
    w = split(d["w"], Replicate(), True)
    y, s = add_rms_norm(x, res, w, 1e-6)
    torch.autograd.backward([y, s], [split(d["gy"], Shard(1)), split(d["gs"], Shard(1))])
    out["add"] = {"y": full(y), "s": full(s), "dx": full(x.grad), "dres": full(res.grad),
                  "dw": full(w.grad), "launches": launches[start:]}

    # parallel/tensor.py's plan for q_norm/k_norm, with the Triton kernel
    norm = RMSNorm(K, kernels={"rms_norm": "triton"})
    with torch.no_grad():
        norm.weight.copy_(d["w"])
    parallelize_module(norm, mesh, HEAD_NORM())
    start = len(launches)
    heads = slice(rank * H // world, (rank + 1) * H // world)
    x_local = d["x"][:, heads].clone().requires_grad_()
    y_local = norm(x_local)
    y_local.backward(d["gy"][:, heads])
    out["module"] = {"y": y_local.detach(), "dx": x_local.grad, "dw": full(norm.weight.grad),
                     "launches": launches[start:], "heads": heads}
    return out


def reference_grads():
    d = data()
    x, res, w = (d[n].clone().requires_grad_() for n in ("x", "res", "w"))
    y = reference.rms_norm(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), d["gy"])
    ya, sa = reference.add_rms_norm(x, res, w)
    dxa, dresa, dwa = torch.autograd.grad((ya, sa), (x, res, w), (d["gy"], d["gs"]))
    return {"y": y.detach(), "dx": dx, "dw": dw}, \
        {"y": ya.detach(), "s": sa.detach(), "dx": dxa, "dres": dresa, "dw": dwa}


def test_triton_norms_on_dtensors_match_the_reference_and_never_see_a_dtensor():
    want, want_add = reference_grads()
    for rank in run_ranks(_tp_rank, 2):
        assert rank["backends"] == ["triton", "triton"]  # the registry's CUDA choice
        for name in ("heads", "tokens", "normed"):
            got = rank[name]
            for key in ("y", "dx", "dw"):
                torch.testing.assert_close(got[key], want[key], msg=f"{name} {key}")
            assert all("DTensor" not in launch for launch in got["launches"]), name
        # the splits that keep the normed dim whole run Triton on the shards (fwd + bwd) ...
        assert len(rank["heads"]["launches"]) == len(rank["tokens"]["launches"]) == 2
        assert str(rank["heads"]["y_placements"]) == "(Shard(dim=1),)"
        # ... a split of the normed dim takes the eager kernel (DTensor's own reductions)
        assert rank["normed"]["launches"] == []
        got = rank["add"]
        for key in want_add:
            torch.testing.assert_close(got[key], want_add[key], msg=f"add_rms_norm {key}")
        assert len(got["launches"]) == 2 and all("DTensor" not in la for la in got["launches"])
        got = rank["module"]
        heads = got["heads"]
        torch.testing.assert_close(got["y"], want["y"][:, heads])
        torch.testing.assert_close(got["dx"], want["dx"][:, heads])
        torch.testing.assert_close(got["dw"], want["dw"])  # all heads' share, all-reduced
        assert len(got["launches"]) == 2 and all("DTensor" not in la for la in got["launches"])
