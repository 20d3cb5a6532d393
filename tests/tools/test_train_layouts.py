"""``parallel:`` in the run config reaches the whole layout through ``omniscale train``
(parallel/parallelize.py): HSDP with encoders on their own mesh, activation checkpointing,
bf16, and the docs' examples are configs the trainer accepts.

Each multi-process layout is compared with one process on the loss and every parameter's
gradient (``debug.dump_grads_at_step``). The aux router loss is off where the packings differ
(its load fractions are a micro-batch's own); the z-loss stays on."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import yaml

from omniscale.tools.train.config import RunConfig, load_config
from omniscale.tools.train.evaluate import evaluate_run
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import assert_same_gradients
from tests.tools.train_runs import assert_same_rows as _same_rows
from tests.tools.train_runs import run_omni as _run

ROOT = Path(__file__).resolve().parents[2]


# the pages whose YAML blocks are run configs (mixing-spec.md's are specs, tested there)
RUN_CONFIG_PAGES = ("README.md", "docs/parallel.md", "docs/training.md", "docs/guides")


def docs_yaml_blocks() -> list[str]:
    pages = [p for name in RUN_CONFIG_PAGES for p in sorted(
        [ROOT / name] if name.endswith(".md") else (ROOT / name).rglob("*.md"))]
    return [block for page in pages
            for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)]


def test_every_run_config_yaml_block_of_the_docs_is_a_run_config():
    blocks = docs_yaml_blocks()
    assert any("parallel:" in b for b in blocks)
    for block in blocks:
        RunConfig.model_validate(yaml.safe_load(block))  # raises on a key the trainer lacks


def test_hsdp_with_encoders_on_their_own_mesh_trains_what_one_process_does(demo, tmp_path,
                                                                           every_source_one):
    """4 processes: the backbone HSDP (2 replicas × FSDP over 2), the encoders FSDP over all 4
    (their own mesh, sized apart from the backbone's)."""
    extra, one, g_one = every_source_one  # 4 steps of one process (tests/tools/conftest.py)
    four, g_four = _run(demo, tmp_path / "four", 4, **extra, **{
        "parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.encoder_dp_shard": 4})
    assert_same_gradients(g_one, g_four, trained=("vision.", "audio.", "decoder."))
    _same_rows(one[:3], four)
    assert sum(r["media_items_moved"] for r in four) > 0


def test_activation_checkpointing_is_bit_exact(demo, tmp_path, every_source_one):
    extra, plain, g_plain = every_source_one  # without checkpointing (tests/tools/conftest.py)
    plain = plain[:2]
    for mode in ("selective", "full"):
        ac, g_ac = _run(demo, tmp_path / mode, 1, steps=2, checkpoint_every=1, **extra,
                        **{"parallel.activation_checkpoint": mode, "checkpoint.keep_last": 1})
        # checkpoints at steps 1 and 2, the older deleted once the newer was complete
        assert [d.name for d in (tmp_path / mode / "checkpoints").glob("step-*")] == ["step-000002"]
        assert (tmp_path / mode / "checkpoints" / "latest").read_text() == "step-000002\n"
        assert [r["loss"] for r in plain] == [r["loss"] for r in ac], mode
        assert [r["grad_norm"] for r in plain] == [r["grad_norm"] for r in ac], mode
        assert g_plain.keys() == g_ac.keys()
        assert all(g_plain[n].equal(g_ac[n]) for n in g_plain), mode


# bf16 parameters (fp32 master weights and gradient reduction) against fp32, 3 steps of the
# demo on CPU (bf16 matmuls are slow on a CPU: 10 steps took 2 minutes of the suite): every
# step's loss within this relative distance.
BF16_LOSS_RTOL = 0.005  # measured: 0.075% at worst


def test_bf16_on_cpu_stays_near_fp32(demo, tmp_path):
    small = {"optim.decay_steps": 3, "data.global_batch_tokens": 2048,
             "data.micro_batch_tokens": 2048}
    fp32, _ = _run(demo, tmp_path / "fp32", 1, steps=3, **small)
    bf16, _ = _run(demo, tmp_path / "bf16", 1, steps=3, **small,
                   **{"parallel.mixed_precision": "bf16"})
    worst = max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(fp32, bf16, strict=True))
    assert worst <= BF16_LOSS_RTOL, worst
    assert any(a["loss"] != b["loss"] for a, b in zip(fp32, bf16))  # bf16 really ran
    assert all(math.isfinite(r["grad_norm"]) for r in bf16)


def test_tensor_parallel_trains_what_one_process_does_and_resumes_without(demo, tmp_path,
                                                                          every_source_one):
    """4 processes: tp 2 × dp_shard 2. The plane plans for the 2 data ranks, each TP pair loads
    the same plan; the encoders stay replicated over the pair (FSDP over all 4), each copy
    passing half the gradient. Its checkpoint resumes in one process without TP, and the next
    step is the one a single process trains. The ranks' held-out evaluation of the last step
    (each TP pair its data rank's slice, the head's logits gathered over the vocabulary) is
    one process's evaluation of the checkpoint (``evaluate_run``)."""
    extra, one, g_one = every_source_one  # 4 steps of one process (tests/tools/conftest.py)
    four, g_four = _run(demo, tmp_path / "tp", 4, **extra, **{
        "parallel.tp": 2, "eval.enabled": True, "eval.max_samples": 6})
    assert_same_gradients(g_one, g_four, trained=("vision.", "audio.", "decoder."))
    _same_rows(one[:3], four)
    evaluated = json.loads((tmp_path / "tp" / "eval.json").read_text())
    cfg, _ = load_config(tmp_path / "tp" / "config.yaml")
    assert evaluated["step"] == 3 and all(r["tokens"] > 0 for r in evaluated["eval"].values())
    assert evaluate_run(cfg, tmp_path / "tp", verbose=False) == evaluated["eval"]
    result = train(None, resume=str(tmp_path / "tp"),
                   sets=["steps=4", "parallel.tp=1", "eval.enabled=false"], progress=False)
    assert result["start_step"] == 3
    resumed = read_metrics(tmp_path / "tp" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert math.isclose(resumed[3]["loss"], one[3]["loss"], rel_tol=1e-5), \
        (resumed[3]["loss"], one[3]["loss"])
