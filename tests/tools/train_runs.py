"""Short demo training runs and the comparisons the trainer's layout tests share: one process
against N on the rows (loss, grad norm, router loss, loss per source) and on every
parameter's gradient (``debug.dump_grads_at_step``)."""

from __future__ import annotations

import math

import torch

from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics

DUMP = 0  # the step whose gradients are compared (later steps: losses and norms)
TINY_MOE = "{num_experts: 8, top_k: 2, expert_ffn_dim: 128"  # the tiny preset's MoE


def every_source(demo, out):
    """The demo's sources at equal weights from step 0: the steps hold video and audio for
    both encoders."""
    from omniscale.tools.demo.specs import every_source_spec

    return every_source_spec(demo, out)


def few_sources(demo, out, names=("text", "image_caption", "audio_caption")):
    """The demo's spec with only ``names`` at equal weights (absolute paths), at ``out``: a
    Ray run starts a decoding actor per source, each a process of its own, and the Ray
    launch tests need not pay for six."""
    import yaml

    spec = yaml.safe_load(every_source(demo, out).read_text())
    spec["sources"] = [s for s in spec["sources"] if s["name"] in names]
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


def demo_sets(demo, out, **overrides) -> list[str]:
    """``--set`` arguments of a short demo run into ``out``: the demo mix and eval spec, decoding
    in the loader thread, one warm-up step, no evaluation -- and ``overrides`` (dotted keys)."""
    sets = {"data.spec": demo / "mix.yaml", "data.eval_spec": demo / "eval.yaml",
            "data.workers": 0, "optim.warmup_steps": 1, "eval.enabled": False,
            "output_dir": out, **overrides}
    return [f"{k}={v}" for k, v in sets.items()]


def run_omni(demo, out, nproc, **extra):
    """A short omni run of the demo (3 steps, no eval) with step DUMP's gradients: (rows,
    gradients)."""
    sets = {"data.spec": demo / "mix.yaml", "data.eval_spec": demo / "eval.yaml",
            "data.workers": 0, "data.global_batch_tokens": 8192,
            "data.micro_batch_tokens": 4096, "optim.warmup_steps": 1, "optim.decay_steps": 4,
            "eval.enabled": False, "output_dir": out, "steps": 3,
            "data.refit_costs_every": 3, "debug.dump_grads_at_step": DUMP, **extra}
    train("configs/demo_omni.yaml", nproc=nproc, sets=[f"{k}={v}" for k, v in sets.items()],
          progress=False)
    grads = torch.load(out / f"grads-step-{DUMP}.pt", weights_only=True)
    return read_metrics(out / "metrics.jsonl"), grads


def assert_same_gradients(one: dict, two: dict, trained=("vision.", "decoder."),
                          rel: float = 1e-5) -> None:
    """Each parameter's gradient: the same name, shape and values (relative to its norm).
    ``trained``: parts whose gradients must not be zero (a vacuous comparison otherwise)."""
    assert one.keys() == two.keys()
    for prefix in trained:
        assert sum(float(g.norm()) for n, g in one.items() if n.startswith(prefix)) > 0, prefix
    worst = []
    for name, a in one.items():
        b = two[name]
        assert a.shape == b.shape, name
        err = float((a.double() - b.double()).norm())
        worst.append((err / max(float(a.double().norm()), 1e-30), name))
    assert all(err <= rel for err, _ in worst), sorted(worst)[-5:]


def assert_same_rows(one, two) -> None:
    """Two runs' rows: the same tokens and mix, losses, norms and router losses within
    float tolerance (router losses on)."""
    assert [r["tokens"] for r in one] == [r["tokens"] for r in two]
    assert [r["mix_samples"] for r in one] == [r["mix_samples"] for r in two]
    assert all(r["router_loss"] > 0 for r in one)  # router losses on
    for a, b in zip(one, two, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (a["loss"], b["loss"])
        # A norm over every gradient, reduced in another order under another layout (TP sums
        # partial norms): float32 noise reaches about 1.5e-6 relative on the demo's data.
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=5e-6), \
            (a["step"], a["grad_norm"], b["grad_norm"])
        assert math.isclose(a["router_loss"], b["router_loss"], rel_tol=1e-6), a["step"]
        assert a["source_loss"].keys() == b["source_loss"].keys()
        for name, value in a["source_loss"].items():
            assert math.isclose(value, b["source_loss"][name], rel_tol=1e-5), name
