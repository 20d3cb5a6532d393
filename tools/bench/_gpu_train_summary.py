"""The trainer runs of tools/bench/gpu_check.sh, summarised into one JSON: median tokens/s,
model TFLOP/s, MFU and step time over the steps after warm-up, peak device memory, the model's
shapes and FLOP coefficients (what tools/bench/_hf_step.py rebuilds the Hugging Face baseline
from), and the host syncs per micro-batch.

    python tools/bench/_gpu_train_summary.py RUN_DIR --out train_summary.json \
        [--syncs-run SYNCS_RUN_DIR]

MFU is the trainer's own (tools/train/step.py ``_omni_row``): each sequence of length L costs
alpha·L + beta·L² FLOPs forward + backward (``ModelConfig.cost_coefficients``: alpha = 6 ×
the active matmul parameters, the LM head included; beta = 6 × n_layers × n_heads × head_dim),
summed over the step's sequences and divided by the step's wall-clock seconds (the slowest
rank's, data waits included) and by the device's peak (tools/train/loop.py ``peak_flops``:
``parallel.peak_tflops``, else 989 TFLOP/s dense bf16 for an H100/H200) × devices. Encoders
are not counted (the lm task has none).

Host syncs per micro-batch come from the run's own rows when it counted them
(``debug.count_host_syncs``), else from ``--syncs-run``: a short run with the flag on, kept
apart because the count hooks every op (tools/train/step_audit.py) and would slow the timed
steps. None when neither has the field (a trainer without the flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import yaml

from omniscale.tools.bench.provenance import provenance
from omniscale.tools.train.metrics import read_metrics

WARMUP = 5  # steps left out: compilation, allocator growth, the first plans
MFU_FORMULA = ("mfu = sum over the step's sequences of (alpha*L + beta*L^2) / step_s / "
               "(peak_flops * devices); alpha = 6*active matmul params (LM head included), "
               "beta = 6*n_layers*n_heads*head_dim (ModelConfig.cost_coefficients, forward + "
               "backward, causal); step_s = the slowest rank's wall-clock step, data waits "
               "included; peak_flops = parallel.peak_tflops or 989e12 (H100/H200 dense bf16, "
               "tools/train/loop.py peak_flops)")


def _median(rows: list[dict], key: str):
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def model_summary(run: Path) -> dict | None:
    """The run's resolved model config (preset + overrides + the tokenizer's vocabulary, as the
    trainer builds it) with its accounting; {"error": ...} when the run's spec cannot be read."""
    from omniscale.tools.train.build import model_config
    from omniscale.tools.train.config import load_config, run_spec

    try:
        cfg, _ = load_config(run / "config.yaml")
        spec = run_spec(cfg, cfg.data.spec)
        mcfg = model_config(cfg, spec.media, spec.tokenizer)
    except Exception as e:  # the summary still reports the timings
        return {"error": f"{type(e).__name__}: {e}"}
    decoder = dataclasses.replace(mcfg, vision=None, audio=None)  # the backbone alone
    alpha, beta = decoder.cost_coefficients()
    params = decoder.param_count()
    return {"preset": cfg.model.preset, "overrides": cfg.model.overrides,
            "decoder_config": dataclasses.asdict(decoder), "vocab_size": decoder.vocab_size,
            "params_total": params, "params_active": decoder.active_param_count(),
            "flops_alpha": alpha, "flops_beta": beta,
            # no activation estimate exists in the code (backbone/config.py accounts parameters
            # and FLOPs only): this is the floor every run pays, fp32 weights + gradients +
            # AdamW's two moments, 16 bytes per parameter
            "model_memory_estimate_gib": None,
            "state_fp32_adamw_gib": 16 * params / 2 ** 30}


def host_syncs(rows: list[dict]) -> dict | None:
    """Median host syncs per micro-batch over the rows that have the field, and the last such
    row's count by op."""
    counted = [r for r in rows if r.get("host_syncs_per_micro_batch") is not None]
    if not counted:
        return None
    return {"per_micro_batch": _median(counted, "host_syncs_per_micro_batch"),
            "steps": len(counted), "by_op_last_step": counted[-1].get("host_syncs")}


def summarise(run: Path, syncs_run: Path | None = None) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    if len(rows) <= WARMUP:
        raise SystemExit(f"{run}: {len(rows)} steps in metrics.jsonl; need more than {WARMUP}")
    steady = rows[WARMUP:]
    samples = sum(sum((r.get("mix_samples") or {}).values()) for r in steady)
    tokens = sum(sum((r.get("mix_tokens") or {}).values()) for r in steady)
    syncs = host_syncs(rows)
    syncs_from = "timed run" if syncs else None
    if syncs is None and syncs_run is not None and (syncs_run / "metrics.jsonl").exists():
        syncs = host_syncs(read_metrics(syncs_run / "metrics.jsonl"))
        syncs_from = f"separate run ({syncs_run.name}, debug.count_host_syncs)" if syncs else None
    mfu, tflops = _median(steady, "mfu"), _median(steady, "tflops_per_s")
    config = yaml.safe_load((run / "config.yaml").read_text()) \
        if (run / "config.yaml").exists() else None
    return {
        "steps": len(rows), "warmup_steps": WARMUP, "steps_measured": len(steady),
        "tokens_per_s": _median(steady, "tokens_per_s"), "tflops_per_s": tflops, "mfu": mfu,
        "mfu_formula": MFU_FORMULA,
        # the peak MFU was taken against (TFLOP/s), so a baseline can be judged by the same one
        "peak_tflops": tflops / mfu if mfu else None,
        "step_s": _median(steady, "step_s"), "data_wait_frac": _median(steady, "data_wait_frac"),
        "tokens_per_step": _median(steady, "tokens"),
        "micro_batches": _median(steady, "micro_batches"),
        "mean_sequence_tokens": tokens / samples if samples else None,
        "peak_mem_gib": max((r.get("peak_mem_gib") or 0.0) for r in rows) or None,
        "host_syncs": syncs, "host_syncs_per_micro_batch": syncs and syncs["per_micro_batch"],
        "host_syncs_source": syncs_from,
        "final_loss": rows[-1]["loss"], "model": model_summary(run), "config": config,
        "provenance": provenance()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--syncs-run", type=Path,
                    help="a run with debug.count_host_syncs, when the timed run has no count")
    args = ap.parse_args(argv)
    summary = summarise(args.run, args.syncs_run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    mfu = f"{summary['mfu']:.1%}" if summary["mfu"] is not None else "n/a"
    print(f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['tflops_per_s']:.1f} TFLOP/s, MFU "
          f"{mfu}, peak {summary['peak_mem_gib']} GiB, host syncs per micro-batch "
          f"{summary['host_syncs_per_micro_batch']} over {summary['steps_measured']} steps "
          f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
