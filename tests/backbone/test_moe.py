"""The MoE layer: dispatch equals a dense per-token loop over experts (outputs and gradients),
the grouped-GEMM path equals the loop path, aux-loss-free bias balances a skewed router, the
router losses behave, and the dispatcher can be swapped from outside."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from backbone.config import ModelConfig, MoEConfig
from backbone.moe import MoE, Experts


def config(**moe) -> ModelConfig:
    base = dict(num_experts=6, top_k=2, expert_ffn_dim=24)
    base.update(moe)
    return dataclasses.replace(ModelConfig.preset("tiny"), d_model=16, moe=MoEConfig(**base))


def dense_loop(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Every token through its k experts one at a time: the definition dispatch must match."""
    expert_TK, weight_TK, _ = moe.route(x_TD)
    e = moe.experts
    rows = []
    for t in range(x_TD.shape[0]):
        y = torch.zeros_like(x_TD[t])
        for j in range(expert_TK.shape[1]):
            k = int(expert_TK[t, j])
            gate, up = F.linear(x_TD[t], e.gate_up_proj[k]).chunk(2)
            y = y + weight_TK[t, j] * F.linear(F.silu(gate) * up, e.down_proj[k])
        rows.append(y)
    y_TD = torch.stack(rows)
    if moe.shared_expert is not None:
        y_TD = y_TD + moe.shared_expert(x_TD)
    return y_TD


def grads(module, x, fn):
    module.zero_grad()
    x = x.detach().requires_grad_()
    y = fn(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()
                                if p.grad is not None}


@pytest.mark.parametrize("moe_kw", [
    dict(router="softmax"), dict(router="softmax", norm_topk_prob=False),
    dict(router="sigmoid", shared_expert=True), dict(top_k=1, bias_update_rate=0.1)])
def test_dispatch_equals_dense_per_token_loop(moe_kw):
    torch.manual_seed(0)
    moe = MoE(config(grouped_mm="loop", **moe_kw)).double()
    moe.expert_bias_E.copy_(torch.randn(6))  # selection-only bias must not change the weights
    x = torch.randn(37, 16, dtype=torch.double)
    y, gx, gp = grads(moe, x, lambda x: moe(x)[0])
    y_ref, gx_ref, gp_ref = grads(moe, x, lambda x: dense_loop(moe, x))
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(gx, gx_ref)
    assert gp.keys() == gp_ref.keys() and "router.weight" in gp
    for name in gp:
        torch.testing.assert_close(gp[name], gp_ref[name], msg=name)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_gemm_equals_loop_with_empty_experts(dtype, tol):
    torch.manual_seed(0)
    experts = Experts(5, 16, 32).to(dtype)
    counts = torch.tensor([0, 7, 0, 12, 3])  # experts 0 and 2 get no tokens
    x = torch.randn(int(counts.sum()), 16, dtype=dtype)
    out = {}
    for path in ("grouped", "loop"):
        experts.grouped_mm = path
        out[path] = grads(experts, x, lambda x: experts(x, counts))
    (y_g, gx_g, gp_g), (y_l, gx_l, gp_l) = out["grouped"], out["loop"]
    torch.testing.assert_close(y_g, y_l, atol=tol, rtol=tol)
    torch.testing.assert_close(gx_g, gx_l, atol=tol, rtol=tol)
    for name in gp_l:
        torch.testing.assert_close(gp_g[name], gp_l[name], atol=tol, rtol=tol)
        assert gp_l[name][[0, 2]].abs().sum() == 0  # empty experts: zero gradient


def test_grouped_path_handles_expanded_gradients():
    experts = Experts(3, 8, 8, grouped_mm="grouped")
    x = torch.randn(6, 8, requires_grad=True)
    experts(x, torch.tensor([2, 0, 4])).sum().backward()  # y.sum(): a stride-0 gradient
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_free_bias_moves_load_toward_uniform(router):
    torch.manual_seed(0)
    moe = MoE(config(router=router, num_experts=8, top_k=2, bias_update_rate=0.005,
                     aux_loss_coef=0.0))
    x = torch.randn(512, 16)
    with torch.no_grad():  # skew: experts 0 and 1 score high for every token
        moe.router.weight.normal_(std=0.1)
        x[:, 0] = 3.0
        moe.router.weight[:2, 0] = 1.0

    def imbalance():
        with torch.no_grad():
            load = moe.route(x)[2]["load_E"].float()
        return (load.max() / load.mean()).item(), load

    start, _ = imbalance()
    trail = []
    for _ in range(150):
        ratio, load = imbalance()
        trail.append(ratio)
        moe.update_bias(load)
    end = sum(trail[-50:]) / 50  # fixed-size sign steps settle into a small cycle
    assert start == 4.0  # experts 0 and 1 take everything: max/mean = 8/2
    assert end < 1.6
    assert moe.expert_bias_E[:2].max() < moe.expert_bias_E[2:].min()


def test_update_bias_is_a_noop_without_rate():
    moe = MoE(config())
    moe.update_bias(torch.tensor([10, 0, 0, 0, 0, 0]))
    assert moe.expert_bias_E.abs().sum() == 0


def test_router_losses():
    torch.manual_seed(0)
    moe = MoE(config(num_experts=4, top_k=1))
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform scores
    x = torch.randn(64, 16, requires_grad=True)
    _, _, aux = moe.route(x)
    # uniform probabilities: E * sum_e f_e / E = 1 whatever the tie-broken loads
    torch.testing.assert_close(aux["aux_loss"], torch.tensor(1.0))
    torch.testing.assert_close(aux["z_loss"], torch.log(torch.tensor(4.0)) ** 2)
    assert aux["load_E"].sum() == 64
    with torch.no_grad():
        moe.router.weight.normal_()
    _, _, aux = moe.route(x)
    (aux["aux_loss"] + aux["z_loss"]).backward()
    assert moe.router.weight.grad.abs().sum() > 0


def test_dispatcher_is_swappable():
    moe = MoE(config())
    calls = []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, x_TD, expert_TK, weight_TK, experts):
            calls.append(expert_TK.shape)
            return self.inner(x_TD, expert_TK, weight_TK, experts)

    x = torch.randn(5, 16)
    expected, _ = moe(x)
    moe.dispatcher = Recording(moe.dispatcher)
    y, _ = moe(x)
    assert calls == [(5, 2)]
    torch.testing.assert_close(y, expected)
