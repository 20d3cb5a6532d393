"""Training steps (forward + backward + AdamW) of a Hugging Face transformers model with our
trainer's shapes, on the token counts of our trainer's GPU run: the baseline of
tools/bench/gpu_check.sh, measured in the same run.

    python tools/bench/_hf_step.py --device cuda --from-summary train_summary.json --out hf.json
    python tools/bench/_hf_step.py --device cpu --tiny --out /tmp/hf_step.json   # smoke test

The model is backbone/hf.py's ``config_to_hf`` of the decoder our trainer built (the summary's
``model.decoder_config``; else ``--preset``): Qwen3-MoE for a MoE preset such as ``1b``, Qwen3
for a dense one, built by transformers without custom code, random init, same parameter count
(checked: a mismatch is printed and recorded).

The baseline gets its best settings: ``flash_attention_2`` when flash_attn imports, else SDPA;
each micro-batch is S sequences of one length L as a plain [S, L] batch (no padding, no mask:
SDPA's fused causal kernel; transformers' packed path, position_ids without a mask, hands SDPA
a dense block mask instead); no activation checkpointing (ours recomputes: selective AC);
transformers' default experts implementation (recorded); fused AdamW on CUDA; the gradient
clipped at 1.0 as ours is; the router's auxiliary loss in the loss as ours has it. Precisions
(``--precisions``): ``autocast`` (fp32 weights and optimizer, bf16 compute: what ours does
through FSDP's mixed precision, and HF Trainer's bf16=True), ``bf16`` (bf16 weights and AdamW
state: faster, less exact), ``fp32``.

Same tokens: from the trainer's summary (tools/bench/_gpu_train_summary.py), its micro-batches
per step and tokens per step (medians of the timed steps); L = its mean sequence length, S =
tokens per micro-batch / L (rounded). Equal lengths give HF the least attention work for those
tokens (the sum of L² is smallest when the lengths are equal), so ``ratio`` (our tokens/s over
HF's) leans toward HF; ``ratio_model_flops`` compares model FLOP/s instead, each batch priced by
the trainer's formula (alpha·L + beta·L² per sequence, ``ModelConfig.cost_coefficients``), and
is fair to both. HF's MFU is taken against the peak the trainer's MFU used.

Timing: ``--warmup`` steps, then ``--steps`` timed ones, each between two device syncs; the
median step. Tensor names: S sequences, L tokens per sequence.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: our packages

from omniscale.backbone.config import ModelConfig  # noqa: E402
from omniscale.backbone.hf import config_to_hf  # noqa: E402
from omniscale.tools.bench.provenance import provenance  # noqa: E402

TINY = {"preset": "tiny", "seq_len": 64, "seqs": 2, "micro_batches": 2, "warmup": 1, "steps": 3}


def hf_model(config: ModelConfig, device: torch.device, attn: str):
    """transformers' model of ``config``: fp32, on ``device``, random init."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = config_to_hf(config)
    fields["output_router_logits"] = config.moe is not None  # the aux loss, as ours has it
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn)
    return model.to(device=device, dtype=torch.float32)


def batch(vocab: int, seqs: int, seq_len: int, micro_batches: int, device, seed: int = 0):
    """``micro_batches`` token batches [S, L] (labels are the ids: HF shifts them itself)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (seqs, seq_len), generator=g).to(device)
            for _ in range(micro_batches)]


def train_step(model, optimizer, micro_batches, precision: str, device: torch.device):
    """One optimizer step over the micro-batches (gradients accumulated, mean loss)."""
    for ids_SL in micro_batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "autocast"):
            loss = model(input_ids=ids_SL, labels=ids_SL, use_cache=False).loss
        (loss / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(config: ModelConfig, precision: str, micro_batches, args, device, attn) -> dict:
    """Build, warm up and time one precision; frees the model afterwards."""
    torch.manual_seed(0)
    model = hf_model(config, device, attn)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    params_hf = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds = [], []
    for i in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        losses.append(train_step(model, optimizer, micro_batches, precision, device))
        sync(device)
        if i >= args.warmup:
            seconds.append(time.perf_counter() - t0)
    result = {
        "params_hf": params_hf, "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "step_s": statistics.median(seconds), "step_s_all": seconds,
        "loss_first": float(losses[0]), "loss_last": float(losses[-1]),
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30
                         if device.type == "cuda" else None)}
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def from_summary(path: Path | None, args) -> tuple[ModelConfig, dict | None]:
    """The decoder config and our run's figures (None without a summary); fills the batch
    shape in ``args`` from the run where not given."""
    ours = None
    if path is None:
        return ModelConfig.preset(args.preset), None
    summary = json.loads(path.read_text())
    model = summary.get("model") or {}
    config = ModelConfig(**model["decoder_config"]) if "decoder_config" in model \
        else ModelConfig.preset(args.preset)
    micro = max(1, round(summary.get("micro_batches") or 1))
    mean_len = summary.get("mean_sequence_tokens")
    if args.micro_batches is None:
        args.micro_batches = micro
    if args.seq_len is None and mean_len:
        args.seq_len = max(2, round(mean_len))
    if args.seqs is None and summary.get("tokens_per_step") and args.seq_len:
        args.seqs = max(1, round(summary["tokens_per_step"] / args.micro_batches / args.seq_len))
    ours = {k: summary.get(k) for k in ("tokens_per_s", "tflops_per_s", "mfu", "peak_tflops",
                                        "tokens_per_step", "micro_batches",
                                        "mean_sequence_tokens", "step_s", "peak_mem_gib")}
    ours["source"] = str(path)
    return config, ours


def human(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--from-summary", type=Path,
                    help="our trainer run's summary (tools/bench/_gpu_train_summary.py): the "
                         "model config, the batch shape and our figures")
    ap.add_argument("--preset", default="1b", help="ModelConfig preset without a summary")
    ap.add_argument("--seq-len", type=int, help="L (default: the run's mean sequence length)")
    ap.add_argument("--seqs", type=int, help="S sequences per micro-batch (default: the run's "
                    "tokens per micro-batch / L)")
    ap.add_argument("--micro-batches", type=int, help="per step (default: the run's)")
    ap.add_argument("--precisions", help="comma-separated: autocast, bf16, fp32 (default: "
                    "autocast,bf16 on CUDA, fp32 on CPU); the first that runs is `ratio`'s "
                    "baseline")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tiny", action="store_true",
                    help=f"tiny shapes and few steps (a smoke test): {TINY}")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.tiny:
        args.preset, args.warmup, args.steps = TINY["preset"], TINY["warmup"], TINY["steps"]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")
    precisions = (args.precisions or ("autocast,bf16" if device.type == "cuda" else "fp32")
                  ).split(",")
    unknown = set(precisions) - {"autocast", "bf16", "fp32"}
    if unknown:
        ap.error(f"--precisions: unknown {sorted(unknown)} (known: autocast, bf16, fp32)")
    import transformers

    started = provenance()
    config, ours = from_summary(args.from_summary, args)
    if args.tiny:  # a summary's shapes first, the tiny ones where it gives none
        for key in ("seq_len", "seqs", "micro_batches"):
            if getattr(args, key) is None:
                setattr(args, key, TINY[key])
    if args.seq_len is None or args.seqs is None or args.micro_batches is None:
        ap.error("--seq-len, --seqs and --micro-batches are needed without --from-summary")
    attn = "flash_attention_2" if device.type == "cuda" and \
        importlib.util.find_spec("flash_attn") is not None else "sdpa"
    micro_batches = batch(config.vocab_size, args.seqs, args.seq_len, args.micro_batches, device)
    tokens = args.seqs * args.seq_len * args.micro_batches
    alpha, beta = config.cost_coefficients()
    flops = args.seqs * args.micro_batches * (alpha * args.seq_len + beta * args.seq_len ** 2)
    peak = ours["peak_tflops"] if ours and ours.get("peak_tflops") else None
    arch = config_to_hf(config)["architectures"][0]
    print(f"HF {arch} (transformers {transformers.__version__}, {human(config.param_count())} "
          f"params, {human(config.active_param_count())} active), {args.micro_batches} "
          f"micro-batch(es) of [{args.seqs}, {args.seq_len}] = {tokens:,} tokens/step, "
          f"{args.warmup} warm-up + {args.steps} timed steps on {device}", flush=True)
    runs = {}
    for precision in precisions:
        try:
            r = measure(config, precision, micro_batches, args, device, attn)
        except Exception as e:  # one precision's failure (an op without a kernel for its
            # dtype, memory) is a result; the other precisions still run
            runs[precision] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  HF {precision:8s} failed: {runs[precision]['error']}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        r["tokens_per_s"] = tokens / r["step_s"]
        r["tflops_per_s"] = flops / r["step_s"] / 1e12
        r["mfu"] = r["tflops_per_s"] / peak if peak else None
        runs[precision] = r
        mfu = f"  MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
        mem = f"  peak {r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else ""
        print(f"  HF {precision:8s} {r['tokens_per_s']:12,.0f} tokens/s  "
              f"{r['tflops_per_s']:8.2f} TFLOP/s{mfu}{mem}  ({r['attn_implementation']}, "
              f"experts {r['experts_implementation']}; loss {r['loss_first']:.3f} -> "
              f"{r['loss_last']:.3f})", flush=True)
        if r["params_hf"] != config.param_count():
            print(f"  warning: {r['params_hf']:,} parameters in HF's build vs "
                  f"{config.param_count():,} in ours", file=sys.stderr)
    timed = [p for p in precisions if "error" not in runs[p]]
    if not timed:
        print("hf_step: no precision ran", file=sys.stderr)
        return 1
    first, best = timed[0], max(timed, key=lambda p: runs[p]["tokens_per_s"])
    result = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "architecture": arch, "hf_config": config_to_hf(config),
        "params_ours": config.param_count(), "params_active": config.active_param_count(),
        "batch": {"seq_len": args.seq_len, "seqs_per_micro_batch": args.seqs,
                  "micro_batches": args.micro_batches, "tokens_per_step": tokens,
                  "flops_per_step": flops, "layout": "[S, L] per micro-batch, no padding, "
                                                   "no mask"},
        "warmup": args.warmup, "steps": args.steps, "attn_implementation": attn,
        "hf": runs, "hf_baseline": first, "hf_best": best, "ours": ours,
        "command": "tools/bench/_hf_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        **started}
    if ours and ours.get("tokens_per_s"):
        result["ratio"] = ours["tokens_per_s"] / runs[first]["tokens_per_s"]
        result["ratio_vs_hf_best"] = ours["tokens_per_s"] / runs[best]["tokens_per_s"]
        if ours.get("tflops_per_s"):
            result["ratio_model_flops"] = ours["tflops_per_s"] / runs[first]["tflops_per_s"]
        mfu = f", MFU {ours['mfu']:.1%}" if ours.get("mfu") is not None else ""
        print(f"  ours (trainer) {ours['tokens_per_s']:10,.0f} tokens/s  "
              f"{ours['tflops_per_s']:8.2f} TFLOP/s{mfu}\n"
              f"  ratio ours/HF {first}: {result['ratio']:.2f} tokens/s, "
              f"{result.get('ratio_model_flops', float('nan')):.2f} model FLOP/s; vs HF "
              f"{best} (fastest): {result['ratio_vs_hf_best']:.2f}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
