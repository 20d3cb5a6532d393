"""The MoE layer: routing and output equal a hand-worked example, transformers' Qwen3-MoE block
and an independent DeepSeek-V3 (sigmoid + selection-only bias) reference; dispatch equals a
dense per-token loop over experts (outputs and gradients), the grouped-GEMM path equals the
loop path, aux-loss-free bias balances a skewed router, the router losses behave, and the
dispatcher can be swapped from outside."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from omniscale.backbone.config import ModelConfig, MoEConfig
from omniscale.backbone.moe import Experts, MoE


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


# ---- independent oracles ----------------------------------------------------------------
# Three tokens, one-hot in dims 0..2, so router.weight[:, t] are token t's logits. Softmax is
# shift-invariant, so logits ln(c) give scores c / Σc:
#   token 0: ln[4, 3, 2, 1] -> [.4, .3, .2, .1]  top-2: e0 .4, e1 .3  normalised 4/7, 3/7
#   token 1: ln[1, 2, 6, 1] -> [.1, .2, .6, .1]  top-2: e2 .6, e1 .2  normalised 3/4, 1/4
#   token 2: ln[3, 1, 1, 5] -> [.3, .1, .1, .5]  top-2: e3 .5, e0 .3  normalised 5/8, 3/8
HAND_LOGITS_TE = [[4, 3, 2, 1], [1, 2, 6, 1], [3, 1, 1, 5]]
HAND_EXPERT_TK = [[0, 1], [2, 1], [3, 0]]
HAND_RAW_TK = [[.4, .3], [.6, .2], [.5, .3]]
HAND_NORM_TK = [[4 / 7, 3 / 7], [3 / 4, 1 / 4], [5 / 8, 3 / 8]]
SILU_1 = 1 / (1 + math.exp(-1))  # silu(1) = 1·sigmoid(1) ≈ 0.7311


def hand_moe(scores_TE, **moe) -> tuple[MoE, torch.Tensor]:
    """A 4-expert, top-2 layer with F = 1 whose expert e maps a one-hot token to
    silu(1)·(e+1) in output dim 4+e: gate row 1 and up row e+1 on dims 0..2, down = e_{4+e}.
    So y[t, 4+e] = w_t(e)·(e+1)·silu(1) shows each combine weight in its own column."""
    moe_layer = MoE(config(num_experts=4, top_k=2, expert_ffn_dim=1, grouped_mm="loop", **moe))
    moe_layer = moe_layer.double()
    with torch.no_grad():
        moe_layer.router.weight.zero_()
        moe_layer.router.weight[:, :3] = torch.tensor(scores_TE, dtype=torch.double).log().T
        moe_layer.experts.gate_up_proj.zero_()
        moe_layer.experts.down_proj.zero_()
        for e in range(4):
            moe_layer.experts.gate_up_proj[e, 0, :3] = 1.0  # gate
            moe_layer.experts.gate_up_proj[e, 1, :3] = e + 1.0  # up
            moe_layer.experts.down_proj[e, 4 + e, 0] = 1.0
    return moe_layer, torch.eye(3, 16, dtype=torch.double)


def hand_output(expert_TK, weight_TK) -> torch.Tensor:
    y_TD = torch.zeros(3, 16, dtype=torch.double)
    for t, (experts, weights) in enumerate(zip(expert_TK, weight_TK)):
        for e, w in zip(experts, weights):
            y_TD[t, 4 + e] = w * (e + 1) * SILU_1
    return y_TD


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_hand_worked_example(norm):
    moe, x_TD = hand_moe(HAND_LOGITS_TE, router="softmax", norm_topk_prob=norm)
    expert_TK, weight_TK, aux = moe.route(x_TD)
    want_TK = HAND_NORM_TK if norm else HAND_RAW_TK
    assert expert_TK.tolist() == HAND_EXPERT_TK
    torch.testing.assert_close(weight_TK, torch.tensor(want_TK, dtype=torch.double),
                               rtol=1e-6, atol=1e-7)  # the router scores in fp32
    assert aux["load_E"].tolist() == [2, 2, 1, 1]
    # e.g. token 0, normalised: y[0, 4] = 4/7·1·silu(1) ≈ .4178, y[0, 5] = 3/7·2·silu(1) ≈ .6266
    torch.testing.assert_close(moe(x_TD)[0], hand_output(HAND_EXPERT_TK, want_TK),
                               rtol=1e-6, atol=1e-7)


def test_sigmoid_router_with_bias_matches_hand_worked_example():
    # sigmoid(ln(p / (1 - p))) = p: token 0 scores [.8, .5, .3, .2], token 1 [.1, .6, .7, .9].
    # Bias [0, 0, .4, .4] is for selection only:
    #   token 0: biased [.8, .5, .7, .6] -> e0, e2; weights from UNbiased .8, .3 -> 8/11, 3/11
    #            (from the biased scores it would be .8/1.5, .7/1.5 = 8/15, 7/15)
    #   token 1: biased [.1, .6, 1.1, 1.3] -> e3, e2; weights .9, .7 -> 9/16, 7/16
    #            (unbiased top-2 would be e3, e2 too; token 0 is the one the bias re-routes)
    #   token 2: all scores .5, bias picks e2, e3 (ties broken by the bias) -> 1/2, 1/2
    scores_TE = [[.8, .5, .3, .2], [.1, .6, .7, .9], [.5, .5, .5, .5]]
    odds_TE = [[p / (1 - p) for p in row] for row in scores_TE]  # hand_moe takes exp(logit)
    moe, x_TD = hand_moe(odds_TE, router="sigmoid", bias_update_rate=0.1)
    moe.expert_bias_E.copy_(torch.tensor([0, 0, .4, .4]))
    expert_TK, weight_TK, aux = moe.route(x_TD)
    want_experts, want_weights = [[0, 2], [3, 2], [2, 3]], [[8 / 11, 3 / 11], [9 / 16, 7 / 16],
                                                            [1 / 2, 1 / 2]]
    assert [sorted(r) for r in expert_TK.tolist()] == [sorted(r) for r in want_experts]
    got = {(t, e): w for t, (es, ws) in enumerate(zip(expert_TK.tolist(), weight_TK.tolist()))
           for e, w in zip(es, ws)}
    want = {(t, e): w for t, (es, ws) in enumerate(zip(want_experts, want_weights))
            for e, w in zip(es, ws)}
    assert got == pytest.approx(want, rel=1e-6)
    assert aux["load_E"].tolist() == [1, 0, 3, 2]
    torch.testing.assert_close(moe(x_TD)[0], hand_output(want_experts, want_weights),
                               rtol=1e-6, atol=1e-7)


def _qwen3_block(moe: MoE, norm: bool):
    """transformers' Qwen3-MoE sparse block holding `moe`'s router and expert weights (the
    stacked [E, 2F, D] layout of transformers ≥ 5, or 4.x's per-expert gate/up/down Linears)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    E, F_ = moe.num_experts, moe.experts.ffn_dim
    cfg = transformers.Qwen3MoeConfig(hidden_size=moe.router.in_features,
                                      moe_intermediate_size=F_, num_experts=E,
                                      num_experts_per_tok=moe.top_k, norm_topk_prob=norm,
                                      hidden_act="silu")
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(cfg).double()
    gate_up, down = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.weight)
        if hasattr(block.experts, "gate_up_proj"):
            block.experts.gate_up_proj.copy_(gate_up)  # gate rows first, then up: as ours
            block.experts.down_proj.copy_(down)
        else:
            for e, expert in enumerate(block.experts):
                expert.gate_proj.weight.copy_(gate_up[e, :F_])
                expert.up_proj.weight.copy_(gate_up[e, F_:])
                expert.down_proj.weight.copy_(down[e])
    return block


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_transformers_qwen3_moe(norm):
    torch.manual_seed(0)
    moe = MoE(config(router="softmax", norm_topk_prob=norm, grouped_mm="loop")).double()
    with torch.no_grad():
        moe.router.weight.normal_()  # peaked scores, so the top-k weights differ clearly
    block = _qwen3_block(moe, norm)
    x_TD = torch.randn(37, 16, dtype=torch.double)
    expert_TK, weight_TK, _ = moe.route(x_TD)
    gate = block.gate(x_TD)
    if isinstance(gate, tuple):  # transformers ≥ 5: (logits, top-k weights, top-k indices)
        _, want_weight_TK, want_expert_TK = gate
        assert torch.equal(expert_TK, want_expert_TK)
        torch.testing.assert_close(weight_TK, want_weight_TK, rtol=1e-6, atol=1e-7)
    y_want = block(x_TD[None])
    y_want = y_want[0] if isinstance(y_want, tuple) else y_want  # 4.x: (y, router_logits)
    torch.testing.assert_close(moe(x_TD)[0], y_want.reshape(37, 16), rtol=1e-6, atol=1e-8)


def deepseek_v3_route(x_TD, router_weight_ED, bias_E, top_k):
    """DeepSeek-V3 routing, written from the paper: s = sigmoid(x·Wᵀ); the k experts with the
    largest s + b; gates g = s / Σ_chosen s, from the scores WITHOUT the bias."""
    s_TE = torch.sigmoid(x_TD.double() @ router_weight_ED.double().T)
    chosen_TK = torch.argsort(s_TE + bias_E.double(), dim=-1, descending=True)[:, :top_k]
    g_TK = torch.stack([s_TE[t, chosen_TK[t]] for t in range(len(s_TE))])
    return chosen_TK, g_TK / g_TK.sum(-1, keepdim=True)


@pytest.mark.parametrize("router,norm", [("sigmoid", True), ("softmax", True),
                                         ("softmax", False)])
def test_biased_router_matches_independent_reference(router, norm):
    """Selection uses scores + bias; weights the unbiased scores (softmax: normalised only with
    norm_topk_prob, as Qwen3; sigmoid: always, as DeepSeek-V3)."""
    torch.manual_seed(0)
    moe = MoE(config(router=router, norm_topk_prob=norm, bias_update_rate=0.01,
                     grouped_mm="loop")).double()
    x_TD = torch.randn(64, 16, dtype=torch.double)
    with torch.no_grad():
        moe.router.weight.normal_(std=0.3)
        moe.expert_bias_E.copy_(torch.tensor([0.3, -0.2, 0.0, 0.25, -0.1, 0.05]))
    expert_TK, weight_TK, _ = moe.route(x_TD)
    if router == "sigmoid":
        want_expert_TK, want_weight_TK = deepseek_v3_route(x_TD, moe.router.weight,
                                                           moe.expert_bias_E, moe.top_k)
        unbiased_TK = deepseek_v3_route(x_TD, moe.router.weight, 0 * moe.expert_bias_E,
                                        moe.top_k)[0]
    else:  # the same recipe with softmax scores
        p_TE = (x_TD @ moe.router.weight.detach().T).softmax(-1)
        want_expert_TK = torch.argsort(p_TE + moe.expert_bias_E, -1, descending=True)[:, :2]
        want_weight_TK = torch.stack([p_TE[t, want_expert_TK[t]] for t in range(64)])
        if norm:
            want_weight_TK = want_weight_TK / want_weight_TK.sum(-1, keepdim=True)
        unbiased_TK = torch.argsort(p_TE, -1, descending=True)[:, :2]
    changed = (want_expert_TK.sort(-1).values != unbiased_TK.sort(-1).values).any(-1)
    assert 5 <= int(changed.sum()) < 64  # the bias re-routes some tokens, not all
    assert torch.equal(expert_TK.sort(-1).values, want_expert_TK.sort(-1).values)
    order = expert_TK.argsort(-1)  # compare weights per (token, expert), whatever the order
    want_order = want_expert_TK.argsort(-1)
    torch.testing.assert_close(weight_TK.gather(-1, order),
                               want_weight_TK.gather(-1, want_order), rtol=1e-6, atol=1e-7)


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


def test_expert_counts_equal_bincount():
    """The routed-copy count without bincount (which syncs on CUDA) counts what it does."""
    from omniscale.kernels.reference import expert_counts

    g = torch.Generator().manual_seed(0)
    for tokens, experts in ((0, 4), (7, 8), (300, 16)):
        expert_TK = torch.randint(0, experts, (tokens, 2), generator=g)
        torch.testing.assert_close(expert_counts(expert_TK, experts),
                                   torch.bincount(expert_TK.reshape(-1), minlength=experts))
