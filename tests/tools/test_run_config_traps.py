"""No demo traps in the run configuration (issue #45, item 6): no default of ``RunConfig``
refers to the demo, a missing spec is one line, towers follow the spec's media (``auto``), a
Hugging Face tower's geometry must be the spec's, a projector starts from scratch only when
asked, and deterministic mode says what it turns off."""

from __future__ import annotations

import dataclasses
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
import yaml

from omniscale.dataplane.spec import load_spec
from omniscale.errors import UserError
from omniscale.tools.cli import main
from omniscale.tools.train.build import model_config, resolve_towers
from omniscale.tools.train.config import RunConfig, load_config
from omniscale.tools.train.launch import train
from omniscale.tools.train.spec_media import spec_towers

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIGS = sorted((ROOT / "configs").glob("demo_*.yaml"))
TINY_WIDTH = 128  # the tiny decoder preset's d_model
DEMO_DATA = ("demo data: `make demo`, or `omniscale data demo DIR` then data.spec: "
             "DIR/mix.yaml, or data.demo: true to generate it at data.spec")
# the tower each media file extension goes through, written out here: the oracle of
# spec_towers, which reads the index instead
TOWER_OF_EXTENSION = {"jpg": "vision", "png": "vision", "mp4": "vision", "wav": "audio",
                      "flac": "audio"}


def _strings(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, str):
        yield value


def test_no_default_refers_to_the_demo():
    cfg = RunConfig()
    assert not [s for s in _strings(cfg.model_dump(mode="json")) if "demo" in s.lower()]
    assert cfg.data.demo is False and cfg.data.spec is None and cfg.data.eval_spec is None
    assert (cfg.model.vision, cfg.model.audio, cfg.model.fresh_projector) == ("auto", "auto",
                                                                               False)


@pytest.mark.parametrize("path", DEMO_CONFIGS, ids=lambda p: p.name)
def test_each_demo_config_turns_the_demo_on_itself(path):
    cfg, raw = load_config(path)
    assert raw["data"]["demo"] is True and cfg.data.demo
    assert cfg.data.spec.startswith("demo/") and cfg.data.eval_spec.startswith("demo/")
    assert cfg.output_dir == f"runs/{path.stem}"


def _error_line(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.removeprefix("omniscale: error: ").rstrip("\n")


def test_a_run_without_a_spec_is_one_line(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(f"steps: 1\noutput_dir: {tmp_path / 'run'}\n")
    got = _error_line(capsys, ["train", str(config), "--no-progress"])
    assert got == f"data.spec: not set: name the mixing spec to train on ({DEMO_DATA})"


def test_a_mistyped_spec_is_one_line_and_no_demo_data(tmp_path, capsys):
    """The walk-through's trap: a spec path that does not exist used to train on generated
    demo data; now it names the path, and nothing is generated there."""
    config = tmp_path / "run.yaml"
    config.write_text(f"steps: 1\noutput_dir: {tmp_path / 'run'}\n"
                      f"data: {{spec: {tmp_path / 'data' / 'mix.yaml'}}}\n")
    got = _error_line(capsys, ["train", str(config), "--no-progress"])
    assert got == f"data.spec: {tmp_path / 'data' / 'mix.yaml'}: no such file ({DEMO_DATA})"
    assert not (tmp_path / "data").exists()


# -- towers: built for the spec's media ---------------------------------------------------

def _spec_of(demo: Path, out: Path, spec_file: str, names: tuple[str, ...]) -> Path:
    """``demo/spec_file`` with only the sources ``names`` at equal weights, written to
    ``out`` (absolute paths)."""
    raw = yaml.safe_load((demo / spec_file).read_text())
    raw["tokenizer"] = str(demo / raw["tokenizer"])
    raw["sources"] = [{**{k: v for k, v in s.items() if k != "weight"},
                       "path": str(demo / s["path"])} for s in raw["sources"]
                      if s["name"] in names]
    assert sorted(s["name"] for s in raw["sources"]) == sorted(names)
    raw["schedule"] = {"unit": "steps", "segments": [
        {"kind": "const", "start": 0, "end": None, "weights": {n: 1 for n in names}}]}
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def _towers_in_shards(source_dir: Path) -> frozenset[str]:
    """The towers the media files of a source's tar shards go through, from the members'
    names."""
    found = set()
    for shard in source_dir.glob("*.tar"):
        with tarfile.open(shard) as tar:
            for name in tar.getnames():
                found.add(TOWER_OF_EXTENSION.get(name.rsplit(".", 1)[-1]))
    return frozenset(found - {None})


@pytest.mark.parametrize("spec_file, names, want", [
    ("mix.yaml", ("text", "docs"), frozenset()),
    ("mix.yaml", ("image_caption",), {"vision"}),
    ("mix.yaml", ("video_caption",), {"vision"}),
    ("mix.yaml", ("audio_caption",), {"audio"}),
    ("mix.yaml", ("text", "audio_caption"), {"audio"}),
    ("mix.yaml", ("image_caption", "audio_caption"), {"vision", "audio"}),
    ("mix.yaml", ("interleaved",), "shards"),  # the index decides
    ("sft.yaml", ("chat",), "shards"),  # conversations: the index decides
])
def test_the_spec_s_sources_say_which_towers_it_needs(demo, tmp_path, spec_file, names, want):
    spec = load_spec(_spec_of(demo, tmp_path / "spec.yaml", spec_file, names))
    if want == "shards":
        want = _towers_in_shards(spec.sources[0].path)
        assert want  # a vacuous comparison otherwise
    assert spec_towers(spec) == want


def test_an_interleaved_source_without_an_index_needs_every_tower(demo, tmp_path):
    shutil.copytree(demo / "train" / "interleaved", tmp_path / "interleaved",
                    ignore=shutil.ignore_patterns("_index*"))
    spec = _spec_of(demo, tmp_path / "spec.yaml", "mix.yaml", ("interleaved",))
    raw = yaml.safe_load(spec.read_text())
    raw["sources"][0]["path"] = str(tmp_path / "interleaved")
    spec.write_text(yaml.safe_dump(raw))
    assert _towers_in_shards(tmp_path / "interleaved") == {"vision"}  # what an index would say
    assert spec_towers(load_spec(spec)) == {"vision", "audio"}


@pytest.mark.parametrize("vision, audio, names, want", [
    ("auto", "auto", ("text",), (None, None)),
    ("auto", "auto", ("image_caption",), ("tiny", None)),
    ("auto", "auto", ("audio_caption", "video_caption"), ("tiny", "tiny")),
    ("small", "tiny", ("text",), ("small", "tiny")),  # named: built whatever the spec holds
    (None, "auto", ("image_caption", "audio_caption"), (None, "tiny")),
])
def test_auto_towers_are_built_for_the_spec_s_media(demo, tmp_path, vision, audio, names,
                                                     want):
    spec = load_spec(_spec_of(demo, tmp_path / "spec.yaml", "mix.yaml", names))
    cfg, _ = load_config(None, [f"model.vision={vision}" if vision else "model.vision=null",
                                f"model.audio={audio}"])
    resolve_towers(cfg, spec)
    assert (cfg.model.vision, cfg.model.audio) == want
    mcfg = model_config(cfg, spec.media, spec.tokenizer)
    d_model = {None: None, "tiny": 64, "small": 256}
    assert (getattr(mcfg.vision, "d_model", None), getattr(mcfg.audio, "d_model", None)) == \
        (d_model[want[0]], d_model[want[1]])


def test_a_run_writes_its_resolved_towers_and_says_what_determinism_turns_off(
        demo, tmp_path, capsys):
    """One step of a config that names no tower, on captions of images only: the run builds
    the vision tower alone and says so in RUN_DIR/config.yaml; deterministic mode (the CPU
    default) names the refit and the rank-speed planning it leaves unsent, once."""
    spec = _spec_of(demo, tmp_path / "images.yaml", "mix.yaml", ("text", "image_caption"))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "steps": 1, "output_dir": str(tmp_path / "run"), "parallel": {"device": "cpu"},
        "data": {"spec": str(spec), "workers": 0, "global_batch_tokens": 4096,
                 "micro_batch_tokens": 4096, "refit_costs_every": 7},
        "eval": {"enabled": False}, "checkpoint": {"final": False}}))
    capsys.readouterr()
    train(str(config), progress=False)
    out = capsys.readouterr().out
    assert out.count("omniscale train: deterministic") == 1
    assert ("omniscale train: deterministic: data.refit_costs_every=7 fits the cost model but "
            "does not send it and data.plan_by_rank_speed measures the ranks' speeds but does "
            "not plan by them (plans depend on the data alone, for a bit-exact resume; "
            "deterministic: false to use them)\n") in out
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (written["model"]["vision"], written["model"]["audio"]) == ("tiny", None)


@pytest.mark.parametrize("refit, by_speed, deterministic, want", [
    (50, True, True, "data.refit_costs_every=50 fits the cost model but does not send it and "
                     "data.plan_by_rank_speed measures the ranks' speeds but does not plan by "
                     "them"),
    (0, True, True, "data.plan_by_rank_speed measures the ranks' speeds but does not plan by "
                    "them"),
    (10, False, True, "data.refit_costs_every=10 fits the cost model but does not send it"),
    (0, False, True, None),
    (50, True, False, None),
])
def test_the_deterministic_notice_names_what_it_turns_off(refit, by_speed, deterministic, want):
    cfg, _ = load_config(None, [f"data.refit_costs_every={refit}",
                                f"data.plan_by_rank_speed={by_speed}",
                                f"deterministic={deterministic}"])
    got = cfg.on_device("cpu").deterministic_notice()
    if want is None:
        assert got is None
    else:
        assert got == (f"omniscale train: deterministic: {want} (plans depend on the data "
                       f"alone, for a bit-exact resume; deterministic: false to use them)")
    # the CPU default is deterministic, a GPU's is not
    default, _ = load_config(None)
    assert default.on_device("cpu").deterministic_notice() is not None
    assert default.on_device("cuda").deterministic_notice() is None


# -- Hugging Face towers: the spec's geometry, and no silent fresh projector --------------

def _qwen2_vl_tower(out: Path, width: int, patch: int = 14) -> Path:
    from omniscale.encoders.hf import vision_to_hf_dir
    from omniscale.encoders.vision import QWEN2_VL, VisionConfig, VisionEncoder

    torch.manual_seed(0)
    config = VisionConfig(**QWEN2_VL, patch_size=patch, temporal_patch_size=2, merge_size=2,
                          d_model=32, n_layers=1, n_heads=2, ffn_dim=64)
    return vision_to_hf_dir(VisionEncoder(config, width), out)


def _whisper_tower(out: Path, width: int, n_mels: int = 80, projector: bool = True) -> Path:
    from omniscale.encoders.audio import AudioConfig, AudioEncoder
    from omniscale.encoders.hf import AUDIO_PROJECTOR, audio_to_hf_dir

    torch.manual_seed(0)
    config = AudioConfig(n_mels=n_mels, d_model=32, n_layers=1, n_heads=4, ffn_dim=64,
                         norm_eps=1e-5, layout="whisper", max_positions=64)
    path = audio_to_hf_dir(AudioEncoder(config, width), out)
    if not projector:  # Whisper itself: no projection to any LLM
        (path / AUDIO_PROJECTOR).unlink()
    return path


def _hf_model_config(demo, sets, **media):
    spec = load_spec(demo / "mix.yaml")
    cfg, _ = load_config(None, ["model.vision=null", "model.audio=null", *sets])
    return model_config(cfg, dataclasses.replace(spec.media, **media), spec.tokenizer)


def test_a_qwen2_vl_tower_needs_the_spec_s_geometry(demo, tmp_path):
    tower = _qwen2_vl_tower(tmp_path / "vl", TINY_WIDTH)
    sets = [f"model.init_from.vision={tower}"]
    assert load_spec(demo / "mix.yaml").media.patch_size == 8  # the demo's, not Qwen2-VL's
    with pytest.raises(UserError) as e:
        _hf_model_config(demo, sets)
    assert str(e.value) == (f"model.init_from.vision {tower}: the tower's geometry is "
                            "{patch_size: 14} but the spec's media: has {patch_size: 8} (set "
                            "media: {patch_size: 14} in the mixing spec and re-index)")
    with pytest.raises(UserError) as e:
        _hf_model_config(demo, sets, patch_size=14, merge_size=1)
    assert str(e.value).startswith(f"model.init_from.vision {tower}: the tower's geometry is "
                                   "{merge_size: 2} but the spec's media: has {merge_size: 1}")
    mcfg = _hf_model_config(demo, sets, patch_size=14)
    assert (mcfg.vision.patch_size, mcfg.vision.temporal_patch_size,
            mcfg.vision.merge_size) == (14, 2, 2)


def test_a_whisper_tower_needs_the_spec_s_mel_bins(demo, tmp_path):
    tower = _whisper_tower(tmp_path / "w", TINY_WIDTH, n_mels=128)
    with pytest.raises(UserError) as e:
        _hf_model_config(demo, [f"model.init_from.audio={tower}"])
    assert str(e.value) == (f"model.init_from.audio {tower}: the tower's geometry is "
                            "{n_mels: 128} but the spec's media: has {n_mels: 80} (set media: "
                            "{n_mels: 128} in the mixing spec and re-index)")


@pytest.mark.parametrize("kind", ["vision", "audio", "whisper"])
def test_a_fresh_projector_only_when_asked(demo, tmp_path, kind):
    if kind == "vision":
        tower, fresh, has = _qwen2_vl_tower(tmp_path / "t", 96), "merger.fc2", \
            "projects to width 96"
    else:
        tower = _whisper_tower(tmp_path / "t", 96, projector=kind == "audio")
        fresh, has = "projector", "projects to width 96" if kind == "audio" else \
            "has no projector"
    which = "vision" if kind == "vision" else "audio"
    sets = [f"model.init_from.{which}={tower}"]
    media = {"patch_size": 14} if kind == "vision" else {}
    with pytest.raises(UserError) as e:
        _hf_model_config(demo, sets, **media)
    assert str(e.value) == (f"model.init_from.{which} {tower}: the tower {has}, the decoder is "
                            f"{TINY_WIDTH} wide: its {fresh} would start untrained "
                            "(model.fresh_projector: true to train one from scratch)")
    mcfg = _hf_model_config(demo, [*sets, "model.fresh_projector=true"], **media)
    assert getattr(mcfg, which).d_model == 32
    # the tower at the decoder's width keeps its own projector: nothing to ask
    same = (_qwen2_vl_tower if kind == "vision" else _whisper_tower)(tmp_path / "same",
                                                                     TINY_WIDTH)
    _hf_model_config(demo, [f"model.init_from.{which}={same}"], **media)
