"""The decoder end to end: packing several sequences gives each exactly what it gets alone
(logits and gradients), the loss counts only labelled tokens, variants build and train."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omniscale.backbone.config import ModelConfig, MoEConfig
from omniscale.backbone.decoder import MoEDecoder


def packed(lengths):
    cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return cu, pos


# The model runs in float64, but the torch references compute norms, rotary and the loss in
# float32, so results agree to float32 precision (a leak across sequences would be O(1)).
TOL = dict(atol=1e-5, rtol=1e-4)


def run(model, embeds_TD, labels_T, lengths):
    """Logits and the summed CE (router losses left out: they are per-batch by design)."""
    cu, pos = packed(lengths)
    hidden, aux = model(embeds_TD, pos, cu, max(lengths))
    loss_sum, n = model.loss(hidden, labels_T)
    return model.logits(hidden), loss_sum, n, aux


VARIANTS = {
    "moe": ModelConfig.preset("tiny"),
    "dense_first_shared_sigmoid_tied": dataclasses.replace(
        ModelConfig.preset("tiny"), n_layers=3, n_dense_layers=1, tie_embeddings=True,
        moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32, shared_expert=True,
                      router="sigmoid", bias_update_rate=1e-3)),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_packing_equals_running_each_sequence_alone(name):
    torch.manual_seed(0)
    model = MoEDecoder(VARIANTS[name]).double()
    lengths = [5, 9, 1, 7]
    ids = torch.randint(0, model.config.vocab_size, (sum(lengths),))
    labels = torch.randint(0, model.config.vocab_size, (sum(lengths),))
    labels[3] = -100
    embeds = model.embed_tokens(ids).detach()

    x = embeds.clone().requires_grad_()
    logits, loss_sum, n, _ = run(model, x, labels, lengths)
    loss_sum.backward()
    packed_grads = {k: p.grad.clone() for k, p in model.named_parameters()
                    if p.grad is not None}
    packed_x_grad = x.grad
    model.zero_grad()

    cu = packed(lengths)[0].tolist()
    alone_grads = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    total_n = 0
    for s, e in zip(cu[:-1], cu[1:]):
        xs = embeds[s:e].clone().requires_grad_()
        logits_s, loss_s, n_s, _ = run(model, xs, labels[s:e], [e - s])
        loss_s.backward()
        torch.testing.assert_close(logits[s:e], logits_s, **TOL)
        torch.testing.assert_close(packed_x_grad[s:e], xs.grad, **TOL)
        for k, p in model.named_parameters():
            if p.grad is not None:
                alone_grads[k] += p.grad
        model.zero_grad()
        total_n += int(n_s)
    assert int(n) == total_n == sum(lengths) - 1
    assert len(packed_grads) >= len(list(model.parameters())) - 1  # all but the table
    for k in packed_grads:
        torch.testing.assert_close(packed_grads[k], alone_grads[k], msg=k, **TOL)


def test_loss_ignores_unlabelled_tokens_and_matches_logits():
    torch.manual_seed(0)
    model = MoEDecoder(ModelConfig.preset("tiny"))
    hidden = torch.randn(6, model.config.d_model)
    labels = torch.tensor([1, -100, 3, 4, -100, 6])
    loss_sum, n = model.loss(hidden, labels)
    ref = torch.nn.functional.cross_entropy(model.logits(hidden), labels, ignore_index=-100,
                                            reduction="sum")
    assert int(n) == 4
    torch.testing.assert_close(loss_sum, ref)


def test_mrope_positions_and_aux():
    torch.manual_seed(0)
    config = ModelConfig.preset("tiny")
    model = MoEDecoder(config)
    lengths = [6, 4]
    cu, pos = packed(lengths)
    x = torch.randn(10, config.d_model)
    text = model(x, pos, cu, 6)[0]
    as_text = model(x, pos, cu, 6, mrope_3T=torch.stack([pos] * 3))[0]
    torch.testing.assert_close(text, as_text)  # equal axes: M-RoPE == RoPE
    grid = torch.stack([pos * 0, pos // 2, pos % 2])
    hidden, aux = model(x, pos, cu, 6, mrope_3T=grid)
    assert not torch.allclose(hidden, text)
    assert aux["load_LE"].shape == (config.n_layers, config.moe.num_experts)
    assert (aux["load_LE"].sum(1) == 10 * config.moe.top_k).all()
    assert aux["router_loss"].requires_grad and aux["aux_loss_L"].shape == (config.n_layers,)


def test_update_bias_reaches_every_moe_layer():
    config = dataclasses.replace(ModelConfig.preset("tiny"), n_layers=3, n_dense_layers=1,
                                 moe=MoEConfig(num_experts=4, top_k=1, expert_ffn_dim=16,
                                               bias_update_rate=0.1))
    model = MoEDecoder(config)
    model.update_bias(torch.tensor([[4, 0, 0, 0], [0, 0, 0, 4]]))
    biases = [layer.ffn.expert_bias_E for layer in model.layers if layer.is_moe]
    assert biases[0].tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    assert biases[1].tolist() == pytest.approx([0.1, 0.1, 0.1, -0.1])
    assert "layers.1.ffn.expert_bias_E" in model.state_dict()  # checkpointed


def test_dense_model_and_a_few_steps_lower_the_loss():
    torch.manual_seed(0)
    config = dataclasses.replace(ModelConfig.preset("tiny"), vocab_size=64)
    model = MoEDecoder(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lengths = [32, 16, 48]
    cu, pos = packed(lengths)
    ids = torch.arange(96) % 8  # a pattern to learn
    labels = torch.cat([torch.roll(ids[s:e], -1) for s, e in zip(cu[:-1], cu[1:])])
    losses = []
    for _ in range(30):
        hidden, aux = model(model.embed_tokens(ids), pos, cu, 48)
        loss_sum, n = model.loss(hidden, labels)
        loss = loss_sum / n + aux["router_loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.update_bias(aux["load_LE"])
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.5
    dense = MoEDecoder(dataclasses.replace(config, moe=None))
    hidden, aux = dense(dense.embed_tokens(ids), pos, cu, 48)
    assert aux["router_loss"] == 0 and hidden.shape == (96, config.d_model)


def test_tiny_step_on_cpu_runs():
    """One fwd+bwd of the `tiny` preset at 2K tokens gives a finite loss and a finite gradient
    for every parameter (its speed is tools/bench's business, not a test's)."""
    torch.manual_seed(0)
    model = MoEDecoder(ModelConfig.preset("tiny"))
    lengths = [512] * 4
    cu, pos = packed(lengths)
    ids = torch.randint(0, model.config.vocab_size, (2048,))
    hidden, aux = model(model.embed_tokens(ids), pos, cu, 512)
    loss_sum, n = model.loss(hidden, ids)
    loss = loss_sum / n + aux["router_loss"]
    loss.backward()
    assert n == 2048 and torch.isfinite(loss)
    grads = {k: p.grad for k, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [k for k, g in grads.items() if g is None or not torch.isfinite(g).all()]


def _loss_and_grads(model, embeds_TD, labels_T, lengths):
    x = embeds_TD.clone().requires_grad_()
    _, loss_sum, n, aux = run(model, x, labels_T, lengths)
    loss = loss_sum / n + aux["router_loss"]
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    grads["inputs_embeds"] = x.grad
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, aux["load_LE"]


@pytest.mark.slow  # CPU torch.compile of 5 ops, forward and backward (seconds each, cached)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch's inductor
def test_compiled_kernels_match_the_reference_path():
    """ModelConfig.kernels={"*": "compiled"}: every op with a compiled CPU backend (norms,
    add+norm, rotary, SwiGLU, unpermute) uses it, the rest keep the reference; the loss and
    every gradient match the reference model to float32 tolerance. A shrunk tiny model (one
    MoE layer plus a dense one with a shared expert) keeps the compile count small."""
    from omniscale import kernels

    base = dataclasses.replace(
        ModelConfig.preset("tiny"), n_layers=2, n_dense_layers=1, vocab_size=256,
        moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=64, shared_expert=True))
    compiled_config = dataclasses.replace(base, kernels={"*": "compiled"})
    torch.manual_seed(0)
    reference_model = MoEDecoder(base)
    compiled_model = MoEDecoder(compiled_config)
    compiled_model.load_state_dict(reference_model.state_dict())
    for op in ("rms_norm", "add_rms_norm", "rotary", "swiglu", "moe_unpermute"):
        assert kernels.backend_of(op, "cpu", compiled_config.kernel_backend(op)) == "compiled"

    lengths = [40, 24]
    ids = torch.randint(0, base.vocab_size, (sum(lengths),))
    labels = torch.randint(0, base.vocab_size, (sum(lengths),))
    embeds = reference_model.embed_tokens(ids).detach()
    want_loss, want, want_load = _loss_and_grads(reference_model, embeds, labels, lengths)
    got_loss, got, got_load = _loss_and_grads(compiled_model, embeds, labels, lengths)
    assert torch.equal(got_load, want_load)  # same routing
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-5)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-4, msg=k)


def test_an_empty_micro_batch_gives_zero_loss_and_finite_gradients():
    # Planned micro-batch slots can be empty on some ranks (every rank runs the same number
    # of micro-batches); they must add nothing, and never NaN.
    from omniscale.backbone.config import ModelConfig
    from omniscale.backbone.decoder import MoEDecoder

    torch.manual_seed(0)
    model = MoEDecoder(ModelConfig.preset("tiny"))
    empty = torch.zeros(0, dtype=torch.long)
    hidden, aux = model(model.embed_tokens(empty), empty, torch.tensor([0], dtype=torch.int32), 0)
    loss_sum, n_tokens = model.loss(hidden, empty)
    (loss_sum + aux["router_loss"] * n_tokens).backward()
    assert float(loss_sum) == 0.0 and int(n_tokens) == 0
    assert torch.isfinite(aux["router_loss"])
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
