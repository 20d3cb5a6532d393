"""``optim.groups`` (issue #21): per-module learning-rate scales and freezing.

The training runs freeze the vision tower but for its projector (the merger, at half the
learning rate) and the whole audio tower: under FSDP the vision blocks are units all frozen,
the patch embedding is split off into a frozen unit of its own (the vision unit keeps the
trained merger), and the audio tower runs forward only. One process trains 4 steps with
checkpoints at 2 and 4; a resume from step 2 and a 2-process run are compared with it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from omniscale.balancer.cost import Costs
from omniscale.dataplane.journal import Journal
from omniscale.dataplane.plane_config import PlaneConfig
from omniscale.dataplane.restore import check_settings
from omniscale.errors import UserError
from omniscale.parallel.fsdp import MixedUnitError, frozen_parts
from omniscale.tools.train.build import build_model, build_optimizer, lr_at
from omniscale.tools.train.config import load_config
from omniscale.tools.train.launch import train
from omniscale.tools.train.loop import layout
from omniscale.tools.train.metrics import read_metrics
from omniscale.tools.train.optim_groups import Groups, resolve, unit_error
from omniscale.tools.train.step import set_lr
from tests.tools.train_runs import assert_same_gradients, assert_same_rows, run_omni

GROUPS = ('[{match: "vision.merger.*", lr_scale: 0.5}, {match: "vision.*", frozen: true}, '
          '{match: "audio.*", frozen: true}]')


def _frozen(name: str) -> bool:
    return name.startswith("audio.") or (name.startswith("vision.")
                                         and not name.startswith("vision.merger."))


@pytest.fixture(scope="module")
def frozen_one(demo, tmp_path_factory):
    """One process, ``GROUPS``, 4 steps, checkpoints at 2 and 4: (run dir, rows, step 0's
    gradients)."""
    out = tmp_path_factory.mktemp("frozen-one") / "one"
    rows, grads = run_omni(demo, out, 1, steps=4, checkpoint_every=2,
                           **{"optim.groups": GROUPS})
    return out, rows, grads


# -- the config --------------------------------------------------------------------------

@pytest.mark.parametrize("groups, want", [
    ('[{match: "vision.*", frozen: true, lr_scale: 0.1}]',
     "config: optim.groups[0]: match 'vision.*': lr_scale and frozen: true together"),
    ('[{match: "a.*"}, {match: "vision.*", lr_scale: 0}]',
     "config: optim.groups[1].lr_scale: Input should be greater than 0, got 0"),
    ('[{match: "vision.*", frozen: yes_please}]',
     "config: optim.groups[0].frozen: Input should be a valid boolean"),
])
def test_bad_groups_are_one_line(groups, want):
    with pytest.raises(UserError) as e:
        load_config(None, [f"optim.groups={groups}"])
    assert str(e.value).startswith(want) and "\n" not in str(e.value)


def test_a_group_matching_nothing_names_the_real_prefixes(demo):
    """The issue's spelling ``encoders.vision.*``: refused before any process starts, in one
    line naming the group, its glob and the names there are."""
    cfg, _ = load_config("configs/demo_omni.yaml", [
        f"data.spec={demo / 'mix.yaml'}",
        'optim.groups=[{match: "audio.*", lr_scale: 2}, {match: "encoders.vision.*", '
        'frozen: true}]'])
    with pytest.raises(UserError) as e:
        layout(cfg, 1)
    assert str(e.value).startswith("optim.groups[1]: match 'encoders.vision.*' matches no "
                                   "parameter (names are plain module paths under: decoder.*, "
                                   "vision.*, audio.*")
    assert "\n" not in str(e.value)


def test_shadowed_and_all_frozen_groups_are_refused():
    cfg, _ = load_config(None, ['optim.groups=[{match: "v.*", frozen: true}, {match: "v.w"}]'])
    with pytest.raises(UserError, match=r"optim.groups\[1\]: every parameter match 'v.w' "
                                        r"matches is taken by an earlier group, first "
                                        r"optim.groups\[0\] \('v.\*'\)"):
        resolve(cfg.optim.groups, ["v.w", "d.w"])
    cfg, _ = load_config(None, ['optim.groups=[{match: "*", frozen: true}]'])
    with pytest.raises(UserError, match="every parameter is frozen"):
        resolve(cfg.optim.groups, ["v.w", "d.w"])


# -- the optimizer -----------------------------------------------------------------------

def test_lr_scale_moves_a_parameter_by_lr_times_scale_on_the_first_step():
    """AdamW's first step moves each element by lr·g/(|g|+eps) ≈ lr·sign(g) (bias-corrected
    moments are g and g²), so with weight decay off a 0.1-scaled group moves 10x less than an
    unscaled one, and a frozen one not at all (nor has it optimizer state)."""
    cfg, _ = load_config(None, [
        "optim.weight_decay=0", "optim.warmup_steps=0", "optim.lr=0.01", "optim.min_lr=0",
        'optim.groups=[{match: "vision.*", lr_scale: 0.1}, {match: "audio.*", frozen: true}]'])
    torch.manual_seed(0)
    model = nn.ModuleDict({n: nn.Linear(4, 3) for n in ("vision", "audio", "decoder")})
    model.audio.requires_grad_(False)  # the trainer's freeze(), before the optimizer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, cfg)
    assert set_lr(optimizer, 0, cfg) == lr_at(0, cfg) == 0.01
    for p in model.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    optimizer.step()
    moved = {n: (p.detach() - before[n]).abs() for n, p in model.named_parameters()}
    for name in ("vision.weight", "vision.bias"):
        torch.testing.assert_close(moved[name], torch.full_like(moved[name], 0.001), rtol=1e-4,
                                   atol=0)
    for name in ("decoder.weight", "decoder.bias"):
        torch.testing.assert_close(moved[name], torch.full_like(moved[name], 0.01), rtol=1e-4,
                                   atol=0)
    assert moved["audio.weight"].max() == moved["audio.bias"].max() == 0
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert id(model.audio.weight) not in held and id(model.audio.bias) not in held
    assert len(optimizer.state) == 4  # vision and decoder only


def test_groups_are_scale_and_decay_pairs():
    cfg, _ = load_config(None, ["optim.weight_decay=0.1",
                                'optim.groups=[{match: "vision.*", lr_scale: 0.1}]'])
    model = nn.ModuleDict({n: nn.Linear(4, 3) for n in ("decoder", "vision")})
    optimizer = build_optimizer(model, cfg)
    got = [(scale, g["weight_decay"], [p.ndim for p in g["params"]])
           for scale, g in zip(optimizer.lr_scales, optimizer.param_groups)]
    assert got == [(1.0, 0.1, [2]), (1.0, 0.0, [1]), (0.1, 0.1, [2]), (0.1, 0.0, [1])]
    set_lr(optimizer, 20, cfg)  # after warm-up: lr_at(20) for the first two, a tenth after
    assert [g["lr"] for g in optimizer.param_groups] == \
        [lr_at(20, cfg)] * 2 + [lr_at(20, cfg) * 0.1] * 2


# -- FSDP units ---------------------------------------------------------------------------

def _tiny_model(demo):
    cfg, _ = load_config("configs/demo_omni.yaml", [f"data.spec={demo / 'mix.yaml'}"])
    _, mcfg, _, _ = layout(cfg, 1)
    with torch.device("meta"):
        return build_model(mcfg, 0, torch.device("meta"))


def test_fsdp_splits_frozen_parts_off_a_unit_or_refuses_in_one_line(demo):
    model = _tiny_model(demo)
    blocks = {*model.vision.blocks, *model.audio.blocks, *model.decoder.layers}
    units = blocks | {model.vision, model.audio}  # what apply_fsdp shards before the root

    def is_unit(m):
        return m in units

    for name, p in model.named_parameters():
        p.requires_grad_(not _frozen(name))
    # frozen blocks are whole units; the vision unit gives its patch embedding one of its own
    assert frozen_parts(model.vision.blocks[0], is_unit) == []
    assert frozen_parts(model.vision, is_unit) == [model.vision.patch_embed]
    assert frozen_parts(model.audio, is_unit) == []  # all frozen: nothing to split
    model.decoder.embed_tokens.weight.requires_grad_(False)
    assert frozen_parts(model, is_unit) == [model.decoder.embed_tokens]

    # one module holding a frozen and a trained weight cannot be split: refused, one line
    experts = model.decoder.layers[0].ffn.experts
    experts.gate_up_proj.requires_grad_(False)
    names = {id(p): n for n, p in model.named_parameters()}
    modules = {id(m): n for n, m in model.named_modules()}
    with pytest.raises(MixedUnitError) as e:
        frozen_parts(model.decoder.layers[0], is_unit, names, modules)
    cfg, _ = load_config(None, [
        'optim.groups=[{match: "decoder.layers.0.ffn.experts.gate_up*", frozen: true}]'])
    line = str(unit_error(Groups(tuple(cfg.optim.groups)), model, e.value))
    assert line == ("optim.groups[0] ('decoder.layers.0.ffn.experts.gate_up*'): FSDP unit "
                    "decoder.layers.0 would hold frozen decoder.layers.0.ffn.experts.gate_up_proj"
                    " and trained decoder.layers.0.ffn.experts.down_proj, both in module "
                    "decoder.layers.0.ffn.experts (freeze or train that module whole)")


# -- the balancer's costs -----------------------------------------------------------------

def test_a_frozen_towers_items_cost_their_forward_only():
    """Costs.from_llm(24, 2): an image of 10 patches costs 3·10 + 1·100 = 130 forward and
    backward (α/8, β/2), a clip of 10 patches (3 + 1·1024)·10 = 10270; forward only, a
    third of that (FLOPs: forward 2·P per token of backward's 4·P)."""
    costs = Costs.from_llm(24.0, 2.0)
    size_M, kind_M = np.array([10, 10, 10]), np.array([0, 1, 2])  # image, video, audio
    assert costs.item_cost(size_M, kind_M).tolist() == [130.0, 10270.0, 130.0]
    frozen = costs.forward_only(("image", "video"))
    got = frozen.item_cost(size_M, kind_M)
    assert got.tolist() == pytest.approx([130 / 3, 10270 / 3, 130.0], rel=1e-12)
    assert frozen.llm == costs.llm
    # the plane prices them so, from the trainer's config through restarts (JSON lists)
    config = PlaneConfig(dp=2, global_batch_tokens=8192, frozen_encoders=["image", "video"])
    assert config.cost_model(24.0, 2.0) == frozen
    calibrated = dataclasses.replace(config, costs={"llm": [1.0, 0.0, 0.0], "image": [3, 0, 0],
                                                    "video": [6, 0, 0], "audio": [9, 0, 0]})
    assert [m.alpha for m in calibrated.cost_model(1.0, 0.0).encoders] == \
        pytest.approx([1.0, 2.0, 9.0])
    start = {"config": json.loads(json.dumps(dataclasses.asdict(config)))}
    check_settings(start, config)
    with pytest.raises(UserError, match=r"frozen encoders \(optim.groups\) \('audio',\): "
                                        r"this state dir was planned with \('image', 'video'\)"):
        check_settings(start, dataclasses.replace(config, frozen_encoders=("audio",)))
    with pytest.raises(UserError, match="unknown encoder kinds"):
        PlaneConfig(dp=1, global_batch_tokens=8192, frozen_encoders=("vision",))


# -- training -----------------------------------------------------------------------------

def test_frozen_parameters_stay_bit_identical_and_have_no_optimizer_state(frozen_one,
                                                                           tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out, rows, grads = frozen_one
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert not any(_frozen(n) for n in grads)  # no gradient reached a frozen parameter
    assert any(n.startswith("vision.merger.") for n in grads)
    dcp_to_torch_save(out / "checkpoints" / "step-000004", tmp_path / "last.pt")
    state = torch.load(tmp_path / "last.pt", weights_only=True)["train"]
    cfg, _ = load_config(out / "config.yaml")
    _, mcfg, _, _ = layout(cfg, 1)
    start = build_model(mcfg, cfg.seed, torch.device("cpu"))  # the run's initial weights
    frozen = [n for n, _ in start.named_parameters() if _frozen(n)]
    assert frozen and all(torch.equal(start.get_parameter(n), state["model"][n])
                          for n in frozen)
    for name in ("vision.merger.fc1.weight", "decoder.layers.0.attn.q_proj.weight"):
        assert not torch.equal(start.get_parameter(name), state["model"][name]), name
    saved = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in state["optimizer"]
             if k.startswith("state.")}
    assert "vision.merger.fc1.weight" in saved and not any(_frozen(n) for n in saved)


def test_a_run_with_a_frozen_tower_resumes_bit_for_bit(frozen_one, tmp_path):
    """... and one that would thaw a tower is refused in one line (the plane planned with
    forward-only costs for it); the checkpoint still resumes with the run's groups (given
    again: the launcher keeps a resume's ``--set`` in RUN_DIR/config.yaml, refused or not)."""
    out, rows, _ = frozen_one
    run = shutil.copytree(out, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-000004")  # resume from step 2's
    thawed = GROUPS.replace(', {match: "audio.*", frozen: true}', "")
    with pytest.raises(UserError) as e:
        train(None, resume=str(run), sets=[f"optim.groups={thawed}"], progress=False)
    assert "frozen encoders (optim.groups) ('image', 'video'): this state dir was planned " \
        "with ('image', 'video', 'audio')" in str(e.value) and "\n" not in str(e.value)
    assert train(None, resume=str(run), sets=[f"optim.groups={GROUPS}"],
                 progress=False)["start_step"] == 2
    resumed = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for want, got in zip(rows, resumed, strict=True):
        assert (got["loss"], got["grad_norm"], got["router_loss"]) == \
            (want["loss"], want["grad_norm"], want["router_loss"]), got["step"]


def test_two_ranks_with_a_frozen_tower_match_one(demo, frozen_one, tmp_path):
    """FSDP over 2 ranks (frozen units, a split one, a tower forward only): the same
    gradients, losses and norms as one process."""
    _, one, g_one = frozen_one
    two, g_two = run_omni(demo, tmp_path / "two", 2, **{"optim.groups": GROUPS})
    assert_same_gradients(g_one, g_two, trained=("decoder.", "vision.merger."))
    assert_same_rows(one[:3], two)
    start = next(r for _, r in Journal(tmp_path / "two" / "plane", readonly=True).records())
    assert start["config"]["frozen_encoders"] == ["image", "video", "audio"]


def test_an_external_plane_is_told_the_frozen_towers_in_one_flag(tmp_path, capsys):
    from omniscale.tools.cli import main

    base = ["plane", "serve", "--state-dir", str(tmp_path / "state"), "--dp", "2",
            "--global-batch-tokens", "4096"]
    assert main(base + ["--frozen-encoders", "image,oops"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "frozen_encoders: unknown encoder kinds ['oops']" in err
