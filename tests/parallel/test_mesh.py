"""ParallelDims: inferred sizes, impossible layouts refused with one line naming the axis, model
checks, and (on 4 real ranks) the named backbone, expert and encoder meshes."""

from __future__ import annotations

import dataclasses

import pytest

from omniscale.parallel.mesh import ParallelDims
from tests.parallel.dist_models import CONFIG
from tests.parallel.multiproc import run_ranks


def test_dp_shard_takes_the_ranks_the_other_axes_leave():
    dims = ParallelDims(tp=2, world_size=8)
    assert (dims.dp_shard, dims.dp, dims.encoder_dp_shard, dims.encoder_dp_replicate) == \
        (4, 4, 8, 1)
    hsdp = ParallelDims(dp_replicate=2, sp=2, ep=4, world_size=8)
    assert (hsdp.dp_shard, hsdp.edp_shard, hsdp.dp) == (2, 1, 4)
    split = ParallelDims(encoder_tp=2, world_size=8)  # encoders: 4 data-parallel TP pairs
    assert (split.encoder_dp_shard, split.encoder_dp_replicate) == (4, 1)


@pytest.mark.parametrize("kwargs, sizes", [
    (dict(dp_shard=4, ep=2), dict(dp=4, edp_shard=2)),  # EP × FSDP: ep borrows dp_shard ranks
    (dict(dp_shard=2, sp=2), dict(dp=2, edp_shard=4)),  # SP × FSDP
    (dict(pp=2, dp_shard=2), dict(dp=2, edp_shard=2)),  # PP × FSDP
    (dict(tp=2, encoder_tp=2), dict(dp=2, encoder_dp_shard=2)),  # TP incl. the encoders
])
def test_combined_layouts_on_four_ranks_validate(kwargs, sizes):
    from tests.parallel.dist_models import omni_model

    dims = ParallelDims(world_size=4, **kwargs)
    dims.validate_for(omni_model(256).config if "pp" not in kwargs else CONFIG)
    assert {name: getattr(dims, name) for name in sizes} == sizes


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_shard=2, tp=2, world_size=8),
     r"dp_replicate·dp_shard·sp·tp·pp = 1·2·1·2·1 = 4: must equal world_size=8"),
    (dict(tp=3, world_size=8), r"dp_shard=-1: world_size=8 is not a multiple"),
    (dict(ep=3, world_size=4), r"ep=3: must divide dp_shard·sp = 4"),
    (dict(tp=0, world_size=4), r"tp=0: must be >= 1"),
    (dict(dp_shard=0, world_size=4), r"dp_shard=0: must be >= 1, or -1"),
    (dict(encoder_dp_shard=3, world_size=4), r"encoder_dp_shard=3: must divide world_size=4"),
    # ep counted as if it added ranks (it splits dp_shard·sp): say so
    (dict(dp_shard=2, ep=2, world_size=4),
     r"= 2: must equal world_size=4 \(ep=2 adds no ranks: it splits dp_shard·sp\)$"),
    (dict(pp=2, sp=2, world_size=4), r"pp=2 with sp=2: the pipeline runner carries no "
                                     r"sequence-parallel layout per micro-batch"),
    (dict(encoder_tp=3, world_size=4), r"encoder_tp=3: must divide world_size=4"),
    (dict(encoder_tp=0, world_size=4), r"encoder_tp=0: must be >= 1"),
    (dict(encoder_dp_shard=4, encoder_tp=2, world_size=4),
     r"encoder_dp_shard·encoder_tp = 4·2: must divide world_size=4"),
])
def test_impossible_layouts_name_the_axis(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        ParallelDims(**kwargs)
    assert "\n" not in str(error.value)  # one line


@pytest.mark.parametrize("kwargs, overrides, message", [
    (dict(tp=8, world_size=8), {}, r"tp=8: must divide n_heads=4 and n_kv_heads=2"),
    (dict(tp=2, sp=2, world_size=4), {}, r"sp=2: must divide the heads each tp rank holds"),
    (dict(ep=8, world_size=8), {}, r"ep=8: must divide moe.num_experts=4"),
    (dict(ep=2, world_size=2), {"moe": None}, r"ep=2: the model has no MoE layers"),
    (dict(pp=4, world_size=4), {}, r"pp=4: more stages than n_layers=2"),
    (dict(tp=2, world_size=2), {"ffn_dim": 127}, r"tp=2: must divide ffn_dim=127"),
    (dict(pp=2, world_size=2), {"tie_embeddings": True},
     r"pp=2: tie_embeddings=True puts the LM head on stage 0"),
    (dict(pp=2, world_size=2), {"vision": {"n_heads": 4}, "audio": {"n_heads": 4}},
     r"pp=2: stage 0 takes token ids, so a model with encoders \(vision, audio\) cannot be"),
    (dict(encoder_tp=8, world_size=8), {"vision": {"n_heads": 4, "ffn_dim": 128}},
     r"encoder_tp=8: must divide vision.n_heads=4"),
    (dict(encoder_tp=4, world_size=4), {"audio": {"n_heads": 4, "ffn_dim": 6}},
     r"encoder_tp=4: must divide audio.ffn_dim=6"),
])
def test_validate_for_model_shapes(kwargs, overrides, message):
    config = dataclasses.replace(CONFIG, **overrides)
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs).validate_for(config)


def test_a_fitting_layout_validates():
    ParallelDims(tp=2, ep=2, world_size=4).validate_for(CONFIG)


def _meshes(rank, world):
    from omniscale.parallel.mesh import fsdp_mesh

    dims = ParallelDims(dp_shard=2, tp=2, ep=2, world_size=world)
    mesh, experts = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
    encoder = dims.build_encoder_mesh("cpu")
    return {"names": mesh.mesh_dim_names,
            "groups": {n: mesh[n].mesh.flatten().tolist()
                       for n in ("tp", "dp_shard", "dp", "dp_shard_sp", "dp_sp")},
            "ep": experts["ep"].mesh.flatten().tolist(),
            "edp_shard": experts["edp_shard"].mesh.flatten().tolist(),
            "encoder": fsdp_mesh(encoder).mesh.flatten().tolist(),
            "fsdp": fsdp_mesh(mesh).mesh.flatten().tolist(),
            "hsdp": fsdp_mesh(ParallelDims(dp_replicate=2, world_size=world)
                              .build_mesh("cpu")).mesh.tolist(),
            "encoder_tp": _encoder_tp(world)}


def _encoder_tp(world):
    from omniscale.parallel.mesh import fsdp_mesh

    mesh = ParallelDims(tp=2, encoder_tp=2, world_size=world).build_encoder_mesh("cpu")
    return {"names": mesh.mesh_dim_names, "tp": mesh["encoder_tp"].mesh.tolist(),
            "fsdp": fsdp_mesh(mesh).mesh.tolist()}


def test_named_meshes_on_four_ranks():
    out = run_ranks(_meshes, 4)
    assert out[0]["names"] == ("pp", "dp_replicate", "dp_shard", "sp", "tp")
    # rank = dp_shard·2 + tp: tp pairs are adjacent ranks, data-parallel groups stride 2.
    assert [o["groups"]["tp"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["groups"]["dp"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(o["groups"]["dp_shard_sp"] == o["fsdp"] == o["groups"]["dp"] for o in out)
    # experts borrow the data-parallel ranks: ep=2 is all of dp_shard·sp here.
    assert [o["ep"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o["edp_shard"] for o in out] == [[0], [1], [2], [3]]
    # the encoders shard over the whole world, whatever the backbone does.
    assert all(o["encoder"] == [0, 1, 2, 3] for o in out)
    # HSDP: FSDP gets a 2-D (replicate, shard) mesh.
    assert all(o["hsdp"] == [[0, 1], [2, 3]] for o in out)
    # encoder_tp: adjacent ranks split an encoder; FSDP shards over the other axis only.
    assert out[0]["encoder_tp"]["names"] == ("encoder_dp_replicate", "encoder_dp_shard",
                                            "encoder_tp")
    assert [o["encoder_tp"]["tp"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["encoder_tp"]["fsdp"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
