"""The trainer builds its model on the meta device, parallelizes it, then gives each rank
memory for its own shards only and initialises them tensor by tensor (``build.init_weights``,
``parallel.load.init_parameters``) -- with the same values in every layout.

- ``30b_a3b`` (Qwen3-30B-A3B shapes: 122 GB of fp32 weights, 61 GB per rank on two) is built
  and parallelized (FSDP + EP) on two gloo processes; neither process's resident memory grows
  by more than a few hundred MiB. Each rank runs under an address-space limit, so a build
  that allocates the model (the old path: built for real, then sharded) fails at once with
  an allocation error instead of taking the machine's memory.
- A mid-size omni model is materialised and initialised on two processes (FSDP + EP, then TP):
  each rank's peak memory grows by at most its shards, one whole tensor and some slack, and
  the ranks' shards put together are exactly one process's model (``build_model`` on the
  CPU, whole: the layout-independence oracle).

Peaks are the kernel's own (``VmHWM``), reset just before the measured part after a warm-up
of what a process pays once (lazy imports, DTensor's sharding caches), as in
tests/parallel/test_load.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import hashlib
import resource

import pytest
import torch

from omniscale.backbone.config import ModelConfig, MoEConfig
from omniscale.encoders.audio import AudioConfig, sinusoids
from omniscale.encoders.vision import VisionConfig
from tests.parallel.multiproc import run_ranks

MiB = 1 << 20
FULL_30B = ModelConfig.preset("30b_a3b").param_count() * 4  # fp32 bytes, ~122 GB
# the whole model fits this many times over in what the meta build may grow by
META_GROWTH = 512 * MiB
# beyond a rank's shards and one whole tensor: allocator and DTensor bookkeeping; local runs
# of the mid-size model grow ~10-20 MiB past shards + one tensor
SLACK = 48 * MiB


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # reported in kB


def _reset_peak() -> int:
    """Frees what can be freed, resets the peak resident size to the current one (Linux:
    ``clear_refs`` 5) and answers that size."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmHWM")


def _limit_memory(extra: int) -> None:
    """At most ``extra`` more bytes of address space for this process: an allocation of the
    whole model fails (RuntimeError) instead of filling the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (_status_bytes("VmSize") + extra,
                                            resource.getrlimit(resource.RLIMIT_AS)[1]))


def _omni(config: ModelConfig) -> ModelConfig:
    """``config`` with both towers (the Whisper layout: a position-table buffer)."""
    return dataclasses.replace(
        config, vision=VisionConfig.preset("tiny"),
        audio=AudioConfig.preset("tiny", layout="whisper", max_positions=64))


TINY = _omni(ModelConfig.preset("tiny"))
# ~115M parameters (460 MB): 8 MoE layers of 16 experts; the largest tensor is an expert
# stack (16 x 1024 x 512, 32 MiB), so half the model (one rank's shards) plus one tensor
# and the slack stay ~150 MiB below the whole model
MID = _omni(ModelConfig(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
                        head_dim=64, ffn_dim=1536,
                        moe=MoEConfig(num_experts=16, top_k=2, expert_ffn_dim=512)))


def _parallelized(config: ModelConfig, dims):
    from omniscale.parallel.parallelize import Settings, parallelize_omni
    from omniscale.tools.train.build import build_model

    model = build_model(config, 0, torch.device("meta"))
    parallelize_omni(model, dims, Settings(), "cpu")
    return model


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _meta_30b(rank, world):
    from omniscale.parallel.mesh import ParallelDims

    _limit_memory(4 << 30)
    _parallelized(TINY, ParallelDims(dp_shard=2, ep=2, world_size=world))  # warm-up
    before = _reset_peak()
    model = _parallelized(ModelConfig.preset("30b_a3b"),
                          ParallelDims(dp_shard=2, ep=2, world_size=world))
    growth = _status_bytes("VmHWM") - before
    params = list(model.parameters())
    return {"growth": growth, "meta": all(p.is_meta for p in params),
            "local": sum(_local(p).numel() * 4 for p in params)}


@pytest.mark.timeout(120)
def test_30b_a3b_is_built_and_parallelized_without_memory():
    ranks = run_ranks(_meta_30b, 2)
    for r in ranks:
        print(f"30b_a3b meta build + FSDP/EP on 2 ranks: peak growth {r['growth'] / MiB:.0f} "
              f"MiB (model {FULL_30B / 2**30:.0f} GiB, shards {r['local'] / 2**30:.0f} GiB)")
        assert r["meta"]
        assert r["local"] <= FULL_30B // 2 + 64 * MiB  # sharded: half the model each
        assert r["growth"] < META_GROWTH, r["growth"]


def _layout_of(tensor: torch.Tensor, module) -> tuple[list[int], list[int]]:
    """(offsets, shape) of this rank's slice of ``tensor`` in the whole model's tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if hasattr(tensor, "to_local"):
        shape, offsets = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements)
        shape, offsets = list(shape), list(offsets)
    else:
        shape, offsets = list(tensor.shape), [0] * tensor.ndim
    if getattr(module, "num_global_experts", None) is not None:  # expert parallelism
        offsets[0] += module.ep_offset
    return offsets, shape


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


def _shards(model) -> dict[str, tuple]:
    """Per tensor (parameters and buffers, by plain name): this rank's slice (offsets,
    shape) and a digest of its values."""
    from omniscale.parallel.dcp import plain_name

    out = {}
    for module_name, module in model.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in own:
            offsets, shape = _layout_of(tensor, module)
            out[plain_name(f"{module_name}.{name}" if module_name else name)] = (
                offsets, shape, _digest(_local(tensor)))
    return out


def _materialized(rank, world, config, dims_kw, measure):
    from omniscale.parallel.mesh import ParallelDims
    from omniscale.tools.train.build import init_model

    dims = ParallelDims(world_size=world, **dims_kw)
    if measure:
        init_model(_parallelized(TINY, dims), 0, torch.device("cpu"))  # warm-up
    model = _parallelized(config, dims)
    before = _reset_peak()
    init_model(model, 0, torch.device("cpu"))
    growth = _status_bytes("VmHWM") - before
    tensors = [*model.parameters(), *model.buffers()]
    return {"growth": growth, "local": sum(_local(t).numel() * 4 for t in tensors),
            "shards": _shards(model)}


def _check_against_one_process(config, ranks):
    from omniscale.tools.train.build import build_model

    whole = build_model(config, 0, torch.device("cpu")).state_dict()
    for name, want in whole.items():
        covered = 0
        for r in ranks:
            offsets, shape, digest = r["shards"][name]
            index = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
            assert digest == _digest(want[index]), (name, offsets, shape)
            covered += int(torch.Size(shape).numel())
        assert covered >= want.numel(), name  # the slices cover the whole tensor
    assert {n for r in ranks for n in r["shards"]} == set(whole)
    return whole


@pytest.mark.timeout(180)
def test_a_mid_size_model_is_initialised_shard_by_shard_as_in_one_process():
    ranks = run_ranks(_materialized, 2, MID, {"dp_shard": 2, "ep": 2}, True)
    whole = _check_against_one_process(MID, ranks)
    full = sum(t.numel() * 4 for t in whole.values())
    largest = max(t.numel() * 4 for t in whole.values())
    for r in ranks:
        print(f"init on 2 ranks: peak growth {r['growth'] / MiB:.0f} MiB; shards "
              f"{r['local'] / MiB:.0f} MiB + largest tensor {largest / MiB:.0f} MiB of a "
              f"{full / MiB:.0f} MiB model")
        assert r["local"] < full * 0.55  # half the model each (buffers are whole)
        assert r["growth"] <= r["local"] + largest + SLACK, r["growth"]


@pytest.mark.timeout(120)
def test_tensor_parallel_shards_are_one_process_s_initialisation():
    run = run_ranks(_materialized, 2, TINY, {"dp_shard": 1, "tp": 2, "encoder_tp": 2}, False)
    _check_against_one_process(TINY, run)


def test_one_process_initialisation_follows_the_model_s_rules():
    """``build_model`` on the CPU: the decoder's Normal(0, init_std) matrices, unit norms,
    zero expert biases; the Whisper position table; PyTorch's default bounds for the towers'
    linears; a fixed function of the seed that leaves the caller's RNG alone."""
    from omniscale.tools.train.build import build_model

    state = torch.get_rng_state()
    model = build_model(TINY, 7, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)
    again = build_model(TINY, 7, torch.device("cpu")).state_dict()
    other = build_model(TINY, 8, torch.device("cpu")).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again[name]), name
    w = model.decoder.layers[1].ffn.experts.gate_up_proj.detach()
    assert abs(float(w.std()) - TINY.init_std) < 0.001 and abs(float(w.mean())) < 0.001
    assert not torch.equal(w, other["decoder.layers.1.ffn.experts.gate_up_proj"])
    # seeded by name: two same-shaped matrices differ
    assert not torch.equal(model.decoder.layers[0].attn.q_proj.weight,
                           model.decoder.layers[0].attn.o_proj.weight)
    assert torch.equal(model.decoder.layers[0].attn_norm.weight, torch.ones(TINY.d_model))
    assert torch.equal(model.decoder.layers[1].ffn.expert_bias_E, torch.zeros(8))
    assert torch.equal(model.audio.pos_embed, sinusoids(64, 64))
    weight, bias = (t.detach() for t in model.vision.blocks[0].qkv.parameters())
    bound = 1 / weight.shape[1] ** 0.5  # nn.Linear's default: U(-1/sqrt(in), 1/sqrt(in))
    assert float(weight.abs().max()) <= bound and float(bias.abs().max()) <= bound
    assert float(bias.abs().max()) > bound * 0.8


def test_a_tensor_the_rules_do_not_set_is_refused():
    from omniscale.parallel.load import init_parameters

    module = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"^layer\.bias: the model's initialisation"):
        init_parameters(module, lambda m: torch.nn.init.zeros_(m.weight), 0, prefix="layer.")


def test_weights_a_checkpoint_gives_are_not_initialised():
    """``init_from`` giving the decoder (``decoder_from_checkpoint``): its parameters stay NaN
    until the checkpoint fills them (``init_weights`` then checks none is left), its buffers
    and the towers get their initial values."""
    from omniscale.tools.train.build import build_model, init_model

    model = build_model(TINY, 0, torch.device("meta"))
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    init_model(model, 0, torch.device("cpu"), loaded=("decoder",))
    assert all(bool(p.isnan().all()) for p in model.decoder.parameters())
    assert torch.equal(model.decoder.layers[1].ffn.expert_bias_E, torch.zeros(8))
    whole = build_model(TINY, 0, torch.device("cpu"))
    for name in ("vision", "audio"):
        for (n, t), want in zip(getattr(model, name).state_dict().items(),
                                getattr(whole, name).state_dict().values()):
            assert torch.equal(t, want), n
