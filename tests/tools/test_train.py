"""``omniscale train`` on the tiny demo, one process: config errors, a short run, resume."""

from __future__ import annotations

import json
import math

import pytest

from omniscale.errors import UserError
from omniscale.tools.cli import main
from omniscale.tools.train.config import load_config
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import demo_sets


def _sets(demo, out, **kw) -> list[str]:
    return demo_sets(demo, out, **{"data.global_batch_tokens": 4096,
                                   "data.micro_batch_tokens": 4096, "optim.decay_steps": 4,
                                   **kw})


@pytest.mark.parametrize("sets, want", [
    (["optim.lrr=1"], "config: optim.lrr: unknown key"),
    (["optim.lr=-1"], "config: optim.lr: Input should be greater than 0, got -1"),
    (["steps=abc"], "config: steps: Input should be a valid integer"),
    (["optim"], "--set 'optim': expected KEY=VALUE"),
    (["steps.x=1"], "config: steps: Input should be a valid integer, got {'x': 1}"),
])
def test_bad_config_is_one_line(sets, want):
    with pytest.raises(UserError) as e:
        load_config(None, sets)
    assert str(e.value).startswith(want) and "\n" not in str(e.value)


def test_cli_bad_key_exit_2(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("steps: 3\nmodel:\n  presett: tiny\n")
    assert main(["train", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"omniscale: error: {cfg}: model.presett: unknown key"


def test_demo_config_is_valid():
    cfg, _ = load_config("configs/demo_omni.yaml")
    assert cfg.task == "omni" and cfg.steps > 0


def test_run_then_resume_matches_uninterrupted(demo, tmp_path):
    full = tmp_path / "full"
    train("configs/demo_omni.yaml", sets=_sets(demo, full, steps=4, checkpoint_every=2),
          progress=False)
    rows = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["tokens"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    for step in (2, 4):
        meta = json.loads((full / "checkpoints" / f"step-{step:06d}" / "meta.json").read_text())
        assert meta["step"] == step and meta["plane_snapshot"]
    assert any(p.is_file() for p in (full / "plane").rglob("*"))  # the plane's state + log

    part = tmp_path / "part"
    train("configs/demo_omni.yaml", sets=_sets(demo, part, steps=2, checkpoint_every=2),
          progress=False)
    result = train(None, resume=str(part), sets=["steps=4"], progress=False)
    assert result["start_step"] == 2
    resumed = read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]


def test_two_processes_train_with_fsdp_and_commit_every_step(demo, tmp_path):
    # Two real processes on gloo, FSDP over both: ranks with and without a modality must
    # reach the encoders in the same backward order (MediaEmbeddings.zero joins the
    # embeddings), and the clip must combine norms from the encoder and backbone meshes.
    # The plans come from a baseline policy (data.balance) through the same plane.
    from omniscale.dataplane.audit import audit_state_dir

    out = tmp_path / "two"
    result = train("configs/demo_omni.yaml", nproc=2, progress=False,
                   sets=_sets(demo, out, steps=2) + ["data.balance=kk_cost"])
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and result["steps"] == 2
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert {r["balance"] for r in rows} == {"kk_cost"}
    report = audit_state_dir(out / "plane")
    assert (report["next_step"], report["duplicated"], report["missing"]) == (2, 0, 0)


def test_an_empty_slot_becomes_a_one_token_batch_that_adds_nothing():
    from omniscale.geometry import MediaGeometry
    from omniscale.loaders.collate import collate
    from omniscale.tools.train.step import placeholder as _placeholder

    stand_in = _placeholder(collate([], MediaGeometry()))
    assert stand_in.num_tokens == 1 and stand_in.labels_T.tolist() == [-100]
    assert stand_in.cu_seqlens_S1.tolist() == [0, 1] and stand_in.max_seqlen == 1
    assert stand_in.vision_grid_thw_V3.shape[0] == 0 and stand_in.audio_frames_A.shape[0] == 0


def test_a_nested_model_override_changes_only_the_fields_it_names(demo):
    """``model.overrides.moe.aux_loss_coef=0`` keeps the preset's other MoE settings (it used
    to replace them with MoEConfig's defaults: a bigger expert than the preset's)."""
    from omniscale.backbone.config import ModelConfig
    from omniscale.dataplane.spec import load_spec
    from omniscale.tools.train.build import model_config

    cfg, _ = load_config("configs/demo_omni.yaml",
                         sets=["model.overrides.moe.aux_loss_coef=0"])
    spec = load_spec(demo / "mix.yaml")
    config = model_config(cfg, spec.media, spec.tokenizer)
    preset = ModelConfig.preset(cfg.model.preset).moe
    assert config.moe.aux_loss_coef == 0
    assert config.moe.expert_ffn_dim == preset.expert_ffn_dim
    assert config.moe.num_experts == preset.num_experts and config.moe.top_k == preset.top_k
