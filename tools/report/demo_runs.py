"""The README's demo figures, from the runs themselves: ``make demo``'s run and the fine-tuning
demo (``configs/demo_sft.yaml``) with its baseline, the same model before fine-tuning.

    python -m omniscale.tools.report.demo_runs [--omni RUN] [--out JSON]

needs a finished ``make demo`` (its run directory and ``demo/``). It summarizes that run
(mean loss per 15-step window, media items moved, data-wait share of step time, held-out
caption accuracy), then trains the fine-tuning demo twice on 2 processes into
``runs/demo_sft_start`` (1 step at a learning rate that moves no float32 weight: the start's
held-out answer accuracy) and ``runs/demo_sft`` (the config as shipped), and checks that the
frozen vision tower came out bit-identical. Writes JSON with provenance.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from omniscale.tools.bench.provenance import provenance

SFT = "configs/demo_sft.yaml"
WINDOW = 15


def run_summary(run_dir: Path) -> dict:
    from omniscale.tools.train.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    step_s = sum(r["step_s"] for r in rows)
    return {
        "run_dir": str(run_dir), "steps": len(rows),
        "loss_windows": [round(sum(r["loss"] for r in rows[i:i + WINDOW]) / len(rows[i:i + WINDOW]),
                               3) for i in range(0, len(rows), WINDOW)],
        "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
        "media_items_moved": sum(r.get("media_items_moved", 0) for r in rows),
        "data_wait_share": sum(r["data_wait_frac"] * r["step_s"] for r in rows) / step_s,
        "eval": json.loads((run_dir / "result.json").read_text()).get("eval", {}),
    }


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from omniscale.dataplane.spec import load_spec
    from omniscale.tools.train import checkpoint
    from omniscale.tools.train.build import build_model, model_config
    from omniscale.tools.train.launch import resolve_config
    from omniscale.tools.train.loop import quiet_torch_notices

    quiet_torch_notices()  # DCP's notice that it loads in one process: that is the intent
    cfg, _ = resolve_config(None, str(run_dir), [])
    spec = load_spec(cfg.data.spec)
    model = build_model(model_config(cfg, spec.media, spec.tokenizer), cfg.seed,
                        torch.device("cpu"))
    checkpoint.load(checkpoint.latest(run_dir)[1], model, None)
    return {n: p.detach() for n, p in model.named_parameters()}


def _train(out: Path, omni: Path, sets: list[str]) -> float:
    from omniscale.tools.train.launch import train

    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    train(SFT, nproc=2, progress=False,
          sets=[f"output_dir={out}", f"model.init_from.run={omni}", *sets])
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--omni", default="runs/demo_omni", help="make demo's run directory")
    parser.add_argument("--out", default="docs/bench/demo_runs.json")
    args = parser.parse_args(argv)
    omni = Path(args.omni)
    result = {"provenance": provenance(), "omni": run_summary(omni)}
    start, tuned = Path("runs/demo_sft_start"), Path("runs/demo_sft")
    _train(start, omni, ["steps=1", "optim.lr=1e-30", "optim.min_lr=0", "optim.warmup_steps=0"])
    seconds = _train(tuned, omni, [])
    before, after = _weights(omni), _weights(tuned)
    vision = [n for n in before if n.startswith("vision.")]
    decoder = [n for n in before if n.startswith("decoder.")]
    result["sft"] = {
        "config": SFT, "seconds": round(seconds, 1), **run_summary(tuned),
        "start_eval": json.loads((start / "result.json").read_text())["eval"],
        "vision_parameters": len(vision),
        "vision_bit_identical": all(torch.equal(before[n], after[n]) for n in vision),
        "decoder_parameters": len(decoder),
        "decoder_moved": sum(not torch.equal(before[n], after[n]) for n in decoder),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    sft = result["sft"]
    print(f"fine-tuning demo: held-out answer accuracy {sft['start_eval']['chat']['accuracy']:.3f}"
          f" -> {sft['eval']['chat']['accuracy']:.3f} (majority "
          f"{sft['eval']['chat']['chance_majority']:.3f}); vision bit-identical "
          f"{sft['vision_bit_identical']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
