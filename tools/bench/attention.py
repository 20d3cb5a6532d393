"""CPU attention benchmark: the "blocked" backend (kernels/blocked_attention.py, the CPU
default) against the SDPA reference (kernels/reference.py, SDPA's fused CPU kernel), forward
plus backward on the same packed batch, in one run.

    .venv/bin/python tools/bench/attention.py --out docs/bench/attention_cpu.json

Shapes: the `tiny` and `small` decoders' attention at 4 × 512 tokens, a mixed-length packed
batch (1024, 512, 256, 128, 128), and two cases the backend hands to SDPA: a sequence longer
than its MAX_LEN and a vision encoder's bidirectional attention over 16 images of 256 patches. The
two alternate rep by rep (a busy machine's drift
hits both alike); the median is reported, with the largest difference of outputs and input
gradients between the two (they compute the same function).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from omniscale.kernels import blocked_attention, reference  # noqa: E402
from omniscale.tools.bench.provenance import provenance  # noqa: E402

# name -> (sequence lengths, query heads, kv heads, head dim, causal)
CASES = {
    "tiny 4x512": ([512] * 4, 4, 2, 32, True),
    "small 4x512": ([512] * 4, 8, 2, 32, True),
    "mixed 2048": ([1024, 512, 256, 128, 128], 8, 2, 32, True),
    "long 1x2048": ([2048], 8, 2, 32, True),  # beyond MAX_LEN: both take SDPA
    "vit 16x256": ([256] * 16, 12, 12, 64, False),  # bidirectional: both take SDPA
}


def step_of(attend, inputs, causal: bool):
    q, k, v, cu, max_len, grad = inputs

    def step():
        out = attend(q, k, v, cu, max_len, causal=causal)
        out.backward(grad)
        grads = [t.grad for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        return out.detach(), grads
    return step


def make_inputs(lengths, heads, kv_heads, head_dim) -> tuple:
    T = sum(lengths)
    q = torch.randn(T, heads, head_dim, requires_grad=True)
    k, v = (torch.randn(T, kv_heads, head_dim, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return q, k, v, cu, max(lengths), torch.randn(T, heads, head_dim)


def measure(name: str, warmup: int, reps: int) -> dict:
    lengths, heads, kv_heads, head_dim, causal = CASES[name]
    inputs = make_inputs(lengths, heads, kv_heads, head_dim)
    steps = {"sdpa": step_of(reference.varlen_attention, inputs, causal),
             "blocked": step_of(blocked_attention.varlen_attention, inputs, causal)}
    (out_a, grads_a), (out_b, grads_b) = (step() for step in steps.values())
    max_diff = max((a - b).abs().max().item()
                   for a, b in zip([out_a, *grads_a], [out_b, *grads_b]))
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = {impl: [] for impl in steps}
    for _ in range(reps):
        for impl, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[impl].append(time.perf_counter() - t0)
    ms = {impl: 1e3 * statistics.median(t) for impl, t in times.items()}
    row = {"case": name, "lengths": lengths, "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "causal": causal, "ms": ms,
           "speedup": ms["sdpa"] / ms["blocked"], "max_abs_diff": max_diff,
           "blocked_runs": [list(run) for run in reference.equal_length_runs(
               inputs[3].tolist(), sum(lengths))
               if blocked_attention.fits(*run, heads, causal, torch.float32)]}
    print(f"{name:12s} fwd+bwd  sdpa {ms['sdpa']:7.2f} ms  blocked {ms['blocked']:7.2f} ms  "
          f"speedup {row['speedup']:.2f}x  (max |diff| {max_diff:.1e})", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated subset of: {', '.join(CASES)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        ap.error(f"--cases: unknown {sorted(unknown)} (known: {', '.join(CASES)})")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"CPU attention ({platform.machine()}, {args.threads} threads, torch "
          f"{torch.__version__}): forward+backward, median of {args.reps}")
    source = provenance()  # before the run: the load it started under
    rows = [measure(name, args.warmup, args.reps) for name in args.cases.split(",")]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "torch": torch.__version__, "threads": args.threads, "reps": args.reps,
            "command": "tools/bench/attention.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "provenance": source, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
