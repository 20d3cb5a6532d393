"""Expert parallelism on real gloo processes equals the dense single-process MoE: outputs,
input gradients, the router's gradient (summed over ranks, as data parallelism would) and the
gradients of the experts each rank owns — with uneven token counts per rank, a rank without
tokens and an expert no token picks."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.multiproc import run_ranks

TOKENS = {2: [7, 3], 4: [6, 0, 9, 2]}  # tokens per rank


def _moe():
    from omniscale.backbone.config import ModelConfig, MoEConfig
    from omniscale.backbone.moe import MoE

    config = ModelConfig(d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, moe=MoEConfig(
        num_experts=4, top_k=2, expert_ffn_dim=6, bias_update_rate=1e-3, grouped_mm="loop"))
    torch.manual_seed(3)
    moe = MoE(config).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    moe.expert_bias_E[1] = -100.0  # expert 1 is never selected: an empty expert
    return moe


def _data(world):
    g = torch.Generator().manual_seed(11)
    T = sum(TOKENS[world])
    return (torch.randn(T, 8, generator=g, dtype=torch.float64),
            torch.randn(T, 8, generator=g, dtype=torch.float64))


def _dense(world):
    moe = _moe()
    x, w = _data(world)
    x.requires_grad_()
    y, _ = moe(x)
    (y * w).sum().backward()
    return moe, x, y


def _ep_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from omniscale.parallel.expert import EPDispatcher, apply_ep

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    moe = apply_ep(_moe(), mesh)
    assert isinstance(moe.dispatcher, EPDispatcher)
    x_all, w_all = _data(world)
    lo = sum(TOKENS[world][:rank])
    rows = slice(lo, lo + TOKENS[world][rank])
    x = x_all[rows].clone().requires_grad_()
    y, _ = moe(x)
    (y * w_all[rows]).sum().backward()
    e = moe.experts
    return {"rows": (rows.start, rows.stop), "y": y.detach(), "x_grad": x.grad,
            "router_grad": moe.router.weight.grad, "experts": (e.ep_offset, e.num_experts),
            "gate_up_grad": e.gate_up_proj.grad, "down_grad": e.down_proj.grad}


@pytest.mark.parametrize("world", [2, 4])
def test_ep_equals_the_dense_moe(world):
    moe, x, y = _dense(world)
    results = run_ranks(_ep_rank, world)
    router_grad = sum(r["router_grad"] for r in results)
    torch.testing.assert_close(router_grad, moe.router.weight.grad)
    owned = []
    for r in results:
        lo, hi = r["rows"]
        torch.testing.assert_close(r["y"], y[lo:hi].detach())
        torch.testing.assert_close(r["x_grad"], x.grad[lo:hi])
        first, n = r["experts"]
        owned += range(first, first + n)
        torch.testing.assert_close(r["gate_up_grad"],
                                   moe.experts.gate_up_proj.grad[first:first + n])
        torch.testing.assert_close(r["down_grad"], moe.experts.down_proj.grad[first:first + n])
    assert owned == [0, 1, 2, 3]
    assert moe.experts.gate_up_proj.grad[1].abs().sum() == 0  # the empty expert

