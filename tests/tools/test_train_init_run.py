"""``model.init_from.run``: a new run starts from an earlier run's weights (the fine-tuning
demo starts from the main demo's), under another layout and with a tower frozen; no optimizer
state or step comes along; what cannot be loaded is one line."""

from __future__ import annotations

import pytest
import torch

from omniscale.dataplane.spec import load_spec
from omniscale.errors import UserError
from omniscale.tools.train import checkpoint
from omniscale.tools.train.build import build_model, model_config
from omniscale.tools.train.launch import resolve_config, train
from omniscale.tools.train.metrics import read_metrics


def _sets(demo, out, **kw) -> list[str]:
    base = {"data.spec": demo / "mix.yaml", "data.workers": 0, "data.global_batch_tokens": 4096,
            "data.micro_batch_tokens": 4096, "optim.warmup_steps": 1, "eval.enabled": False,
            "output_dir": out}
    return [f"{k}={v}" for k, v in {**base, **kw}.items()]


def _weights(run_dir) -> dict[str, torch.Tensor]:
    cfg, _ = resolve_config(None, str(run_dir), [])
    spec = load_spec(cfg.data.spec)
    model = build_model(model_config(cfg, spec.media, spec.tokenizer), cfg.seed,
                        torch.device("cpu"))
    checkpoint.load(checkpoint.latest(run_dir)[1], model, None)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_run_starts_from_an_earlier_run_s_weights(demo, tmp_path):
    train("configs/demo_omni.yaml", progress=False, sets=_sets(demo, tmp_path / "a", steps=2))
    before = _weights(tmp_path / "a")
    # the fine-tuning demo's config (conversations, the vision tower frozen) for one step at a
    # learning rate too small to move a float32 weight, on 2 processes: the checkpoint it
    # writes holds the earlier run's weights
    train("configs/demo_sft.yaml", nproc=2, progress=False, sets=_sets(
        demo, tmp_path / "b", steps=1, **{"data.spec": demo / "sft.yaml", "optim.lr": 1e-30,
                                          "optim.min_lr": 0.0,
                                          "model.init_from.run": tmp_path / "a"}))
    rows = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert rows[0]["step"] == 0 and set(rows[0]["mix_samples"]) == {"chat"}  # a new run
    assert 0 < rows[0]["target_tokens"] < rows[0]["tokens"]  # answers only
    after = _weights(tmp_path / "b")
    fresh = build_model(model_config(*_config_of(tmp_path / "b")), 0, torch.device("cpu"))
    assert before.keys() == after.keys()
    for name, weight in before.items():
        assert torch.equal(after[name], weight), name
    moved = [n for n, p in fresh.named_parameters() if not torch.equal(p, before[n])]
    # the earlier run's weights, not a fresh initialisation: what its 2 steps trained (its
    # first steps hold text and images, no audio) differs from a new model's
    assert {n.split(".")[0] for n in moved} >= {"decoder", "vision"}

    with pytest.raises(UserError, match=r"^model\.init_from\.run .*: no checkpoint in it"):
        train("configs/demo_omni.yaml", progress=False,
              sets=_sets(demo, tmp_path / "c", steps=1, **{"model.init_from.run": tmp_path}))
    with pytest.raises(UserError, match=r"model\.init_from: .*run: either an earlier run or "
                                        r"Hugging Face directories, not both"):
        train("configs/demo_omni.yaml", progress=False,
              sets=_sets(demo, tmp_path / "d", steps=1, **{"model.init_from.run": tmp_path / "a",
                                                           "model.init_from.vision": tmp_path}))
    with pytest.raises(UserError, match=r"^model\.init_from\.run .*: cannot load its weights "
                                        r"into this model"):
        train("configs/demo_omni.yaml", progress=False, sets=_sets(
            demo, tmp_path / "e", steps=1, **{"model.init_from.run": tmp_path / "a",
                                              "model.overrides.d_model": 96}))


def _config_of(run_dir):
    cfg, _ = resolve_config(None, str(run_dir), [])
    spec = load_spec(cfg.data.spec)
    return cfg, spec.media, spec.tokenizer


def test_a_decoder_the_checkpoint_gives_is_never_initialised(demo):
    """Every model is built on the meta device (memory comes per shard after parallelization,
    ``build.init_model``); with ``init_from`` giving the decoder, its parameters stay NaN until
    the checkpoint fills them, while the towers get their initial values."""
    from omniscale.tools.train.build import decoder_from_checkpoint, init_model
    from omniscale.tools.train.config import load_config

    cfg, _ = load_config("configs/demo_omni.yaml", [f"data.spec={demo / 'mix.yaml'}",
                                                    "model.init_from.run=runs/x"])
    spec = load_spec(cfg.data.spec)
    assert decoder_from_checkpoint(cfg)
    model = build_model(model_config(cfg, spec.media, spec.tokenizer), 0, torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())
    init_model(model, 0, torch.device("cpu"), loaded=("decoder",))
    assert all(bool(p.isnan().all()) for p in model.decoder.parameters())
    towers = [*model.vision.parameters(), *model.audio.parameters()]
    assert not any(bool(p.isnan().any()) for p in towers)
    cfg.parallel.pp = 2  # a stage is initialised, then loaded over
    assert not decoder_from_checkpoint(cfg)
