"""Activation checkpointing is exact: `full` and `selective` give the loss and gradients of the
same model without checkpointing (one process; with FSDP and TP it runs in test_tp), keep
state-dict keys, and recompute what they promise: full re-runs every block's matmuls in
backward, selective re-runs none (it keeps their outputs) but saves less than no AC.

Selective AC runs each attention backend and each expert all-to-all once in forward and
backward together, as without AC (counted per op by a dispatch mode outside the checkpoint,
which sees an op only when it executes, not when selective AC hands back its kept output),
and the policy keeps the op every attention backend dispatches."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from omniscale.parallel.checkpointing import apply_ac, op_name, selective_saves
from tests.parallel.dist_models import (
    CONFIG,
    TextLM,
    assert_grads_close,
    build,
    full_grads,
    global_tokens,
    pack,
    sequences,
    shard,
    step_loss,
)
from tests.parallel.multiproc import run_ranks

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
# The products of the attention backends that train on CPU: blocked (score and output bmm's)
# and the SDPA reference (one fused op); only attention issues them in these models.
ATTENTION = ("aten::baddbmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu")
# The expert dispatch's exchanges (counts, tokens out, tokens back), as the old dist API or as
# functional collectives.
EXCHANGES = ("c10d::alltoall_base_", "_c10d_functional::all_to_all_single")


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in MATMULS
        return func(*args, **(kwargs or {}))


class CountOps(TorchDispatchMode):
    """Executions of each op, by "namespace::name"."""

    def __init__(self):
        super().__init__()
        self.n: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        self.n[name] = self.n.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def of(self, names) -> dict[str, int]:
        return {name: self.n[name] for name in names if name in self.n}


def run(mode: str | None) -> dict:
    model = build()
    if mode:
        apply_ac(model, mode)
    seqs = sequences()
    saved = []

    def pack_hook(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        loss = step_loss(model, pack(seqs), global_tokens(seqs))
    with CountMatmuls() as backward:
        loss.backward()
    return {"model": model, "loss": loss.item(), "grads": full_grads(model),
            "saved": sum(saved), "backward_matmuls": backward.n}


@pytest.fixture(scope="module")
def runs():
    return {mode: run(mode) for mode in (None, "full", "selective")}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_ac_gives_identical_loss_and_gradients(runs, mode):
    plain, ac = runs[None], runs[mode]
    assert ac["loss"] == plain["loss"]
    assert_grads_close(ac["grads"], plain["grads"], rtol=0, atol=0)
    assert ac["model"].state_dict().keys() == plain["model"].state_dict().keys()


def test_recompute_is_what_each_mode_promises(runs):
    plain, full, selective = runs[None], runs["full"], runs["selective"]
    assert full["saved"] < plain["saved"]  # the outer graph keeps only block inputs
    assert full["backward_matmuls"] > plain["backward_matmuls"]  # forward matmuls re-run
    assert selective["backward_matmuls"] == plain["backward_matmuls"]  # outputs kept


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode 'some': choose one of full, selective"):
        apply_ac(build(), "some")


# ---- attention and expert all-to-alls run once ---------------------------------------------

def attention_runs(backend: str, mode: str | None) -> tuple[dict, float, dict]:
    """(attention products executed in forward + backward, loss, gradients)."""
    torch.manual_seed(0)
    model = TextLM(dataclasses.replace(CONFIG, attention_backend=backend))
    if mode:
        apply_ac(model, mode)
    seqs = sequences()
    with CountOps() as ops:
        loss = step_loss(model, pack(seqs), global_tokens(seqs))
        loss.backward()
    return ops.of(ATTENTION), loss.item(), full_grads(model)


@pytest.mark.parametrize("backend", ["blocked", "reference"])
def test_selective_runs_attention_once(backend):
    plain, plain_loss, plain_grads = attention_runs(backend, None)
    full, _, _ = attention_runs(backend, "full")
    selective, loss, grads = attention_runs(backend, "selective")
    assert plain and full != plain  # the counts see attention, and full AC's recompute
    assert selective == plain
    assert loss == plain_loss
    assert_grads_close(grads, plain_grads, rtol=0, atol=0)


def seen_by_selective_ac(fn, *args) -> list:
    """The ops selective AC's policy is asked about while `fn(*args)` runs."""
    seen = []

    def record(ctx, op, *args, **kwargs):
        seen.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    forward, _ = create_selective_checkpoint_contexts(record)
    with forward:
        fn(*args)
    return seen


@pytest.mark.parametrize("backend", ["blocked", "flex", "reference"])
def test_policy_keeps_the_op_each_cpu_attention_backend_dispatches(backend):
    from omniscale import kernels

    attend = kernels.get("varlen_attention", "cpu", prefer=backend)
    assert attend._omniscale_backend == backend
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, h, 8, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex: eager on CPU
        seen = seen_by_selective_ac(attend, q, k, v, cu, 6)
    kept = {op_name(op) for op in seen if selective_saves(op)}
    want = {"blocked": {"aten::baddbmm", "aten::bmm"},  # its softmax is recomputed
            "flex": {"higher_order::flex_attention"},
            "reference": {"aten::_scaled_dot_product_flash_attention_for_cpu"}}[backend]
    assert kept == want


def test_policy_keeps_varlen_attn():
    """torch's varlen_attn (flash on CUDA) is one custom op; its fake kernel runs on meta."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (torch.empty(10, 4, 8, device="meta") for _ in range(3))
    cu = torch.tensor([0, 6, 10], dtype=torch.int32, device="meta")
    seen = seen_by_selective_ac(lambda: varlen_attn(q, k, v, cu, cu, 6, 6))
    assert [op_name(op) for op in seen] == ["torch_attn::_varlen_attn"]
    assert selective_saves(seen[0])


def test_policy_keeps_functional_overloads_only():
    """An `out=` overload (as compiled code calls matmuls) or a collective that fills a given
    tensor is recomputed: a kept output would not reach the tensor its caller reads."""
    assert selective_saves(torch.ops.aten.mm.default)
    assert selective_saves(torch.ops._c10d_functional.all_to_all_single.default)
    assert not selective_saves(torch.ops.aten.mm.out)
    assert not selective_saves(torch.ops.aten.baddbmm.out)
    assert not selective_saves(torch.ops.c10d.alltoall_base_.default)
    assert not selective_saves(torch.ops.aten._softmax.default)


def _ep_rank(rank: int, world: int) -> dict:
    """Per AC mode: this rank's loss, gradients and expert exchanges, under EP over `world`."""
    from torch.distributed.device_mesh import init_device_mesh

    from omniscale.parallel.expert import apply_ep

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    seqs = sequences()
    out = {}
    for mode in (None, "full", "selective"):
        model = apply_ep(build(), mesh)
        if mode:
            apply_ac(model, mode)
        with CountOps() as ops:
            loss = step_loss(model, shard(seqs, rank, world), global_tokens(seqs))
            loss.backward()
        out[mode] = {"exchanges": sum(ops.of(EXCHANGES).values()), "loss": loss.item(),
                     "grads": full_grads(model)}
    return out


def test_selective_runs_expert_all_to_alls_once():
    """One MoE layer: 3 exchanges forward (counts, tokens, results), 2 backward."""
    for rank in run_ranks(_ep_rank, 2):
        plain, full, selective = rank[None], rank["full"], rank["selective"]
        assert plain["exchanges"] == 5 and full["exchanges"] == 8  # full AC re-issues them
        assert selective["exchanges"] == plain["exchanges"]
        assert selective["loss"] == plain["loss"]
        assert_grads_close(selective["grads"], plain["grads"], rtol=0, atol=0)


def test_policy_keeps_a_region_compiled_as_one_op():
    """Compiled flex attention (the CUDA fallback) is inductor's kernels; kernels.flex compiles
    it as one wrapped region, which selective AC keeps (a tiny function here: compiling flex
    on CPU takes most of a minute)."""
    from omniscale.kernels.flex import compile_as_one_op

    region = compile_as_one_op(lambda x: (x * 2).sin() + 1)
    x = torch.randn(4, 8)
    region(x)  # compiled outside the mode
    seen = seen_by_selective_ac(region, x)
    assert [op_name(op) for op in seen] == ["higher_order::inductor_compiled_code"]
    assert selective_saves(seen[0])
