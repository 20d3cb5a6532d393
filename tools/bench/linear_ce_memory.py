"""Peak memory of fused (chunked) linear cross-entropy vs the unfused reference, forward +
backward, on CPU. Target (issue 7): fused ≤ 25% of unfused at V = 151,936 and 8K tokens.

    .venv/bin/python tools/bench/linear_ce_memory.py --out docs/bench/linear_ce_memory.json

Each variant runs in a fresh child process and reports its peak resident set size
(``ru_maxrss``), so torch's allocations are counted (tracemalloc would not see them) and one
variant's freed memory cannot hide in the other's. Reported per variant: the whole process's
peak, and the peak above what the process held just before the loss (inputs, weight and
libraries already loaded: the loss's own cost).

Which fused path is measured: ``kernels.fused.chunked_linear_cross_entropy``, the chunked
algorithm with its per-chunk step in plain torch. The Triton path runs the same chunk loop
with the step as a Triton kernel (in place on the same logits buffer, so no more memory);
on CPU Triton only runs in its interpreter, far too slow for 8K × 151,936.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(variant: str, tokens: int, vocab: int, d_model: int) -> dict:
    import torch

    from omniscale.kernels import fused, reference
    fn = {"unfused": reference.linear_cross_entropy,
          "fused": fused.chunked_linear_cross_entropy}[variant]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, d_model, generator=g).requires_grad_()
    weight = (torch.randn(vocab, d_model, generator=g) / d_model ** 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::10] = -100
    before = rss_bytes()
    t0 = time.perf_counter()
    loss = fn(hidden, weight, labels, -100, "mean")
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"variant": variant, "peak_bytes": peak, "before_bytes": before,
            "loss_peak_bytes": peak - before, "seconds": seconds, "loss": loss.item(),
            "grad_hidden_norm": hidden.grad.norm().item(),
            "grad_weight_norm": weight.grad.norm().item()}


def measure(variant: str, args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens",
                          str(args.tokens), "--vocab", str(args.vocab), "--d-model",
                          str(args.d_model)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def gib(n: float) -> str:
    return f"{n / 2 ** 30:6.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", choices=["unfused", "fused"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.d_model)))
        return
    print(f"linear cross-entropy, forward+backward, fp32 on CPU: T={args.tokens} "
          f"V={args.vocab} D={args.d_model} (logits alone: "
          f"{gib(4 * args.tokens * args.vocab).strip()})", flush=True)
    from omniscale.tools.bench.provenance import provenance

    source = provenance()  # before the run: the load it started under
    rows = {}
    for variant in ("unfused", "fused"):
        rows[variant] = r = measure(variant, args)
        print(f"{variant:8s} peak RSS {gib(r['peak_bytes'])}  above inputs "
              f"{gib(r['loss_peak_bytes'])}  {r['seconds']:6.1f} s  loss {r['loss']:.6f}",
              flush=True)
    ratio = rows["fused"]["peak_bytes"] / rows["unfused"]["peak_bytes"]
    ratio_loss = rows["fused"]["loss_peak_bytes"] / rows["unfused"]["loss_peak_bytes"]
    agree = abs(rows["fused"]["loss"] - rows["unfused"]["loss"]) <= 1e-4 * abs(
        rows["unfused"]["loss"])
    print(f"fused / unfused: peak RSS {ratio:.1%}, above inputs {ratio_loss:.1%} "
          f"(target ≤ 25%: {'met' if ratio <= 0.25 else 'NOT met'}); losses agree: {agree}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "tokens": args.tokens, "vocab": args.vocab, "d_model": args.d_model,
            "dtype": "float32", "device": "cpu",
            "fused_path": "kernels.fused.chunked_linear_cross_entropy (torch per-chunk step)",
            "variants": rows, "peak_ratio": ratio, "loss_peak_ratio": ratio_loss,
            "target": 0.25, "met": ratio <= 0.25, "losses_agree": agree,
            "provenance": source}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
