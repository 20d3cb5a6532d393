"""Kernel benchmark: each fused op's implementations against its torch reference, in one run.

    .venv/bin/python tools/bench/kernel_ops.py --device cpu  --out docs/bench/kernels_cpu.json
    .venv/bin/python tools/bench/kernel_ops.py --device cuda --out docs/bench/kernels_h200.json

Every implementation is named as the registry names it: ``reference`` (kernels/reference.py,
plain torch autograd), ``eager`` (kernels/eager.py: one autograd node, hand-written backward; the
CPU default where it exists), ``compiled`` (torch.compile of the reference, kernels/compiled.py)
and, on CUDA, ``triton``. Ratios are the reference's time over each implementation's,
forward+backward; Triton is not timed on CPU (it only runs there in its interpreter). CUDA mode adds
the Triton kernels and reports
achieved bandwidth (memory-bound ops: the minimum bytes each op must move) or FLOP/s (fused
linear cross-entropy: 6·T·V·D for forward+backward) as a fraction of the H200's peak
(4.8 TB/s HBM3e, 989 TFLOP/s dense bf16). Times are medians, the implementations alternating
rep by rep; compile time is excluded (warm-up).
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

from omniscale.kernels import reference  # noqa: E402
from omniscale.tools.bench.provenance import provenance  # noqa: E402

PEAK_BYTES_S = 4.8e12  # H200 HBM3e
PEAK_FLOP_S = 989e12  # H200 dense bf16


def cases(device: str, dtype: torch.dtype) -> dict:
    """op -> (make_inputs() -> (args, grad_inputs), fwd+bwd bytes or None, fwd+bwd flops or None).
    Bytes count each tensor the op must read or write once, forward then backward."""
    big = device == "cuda"
    T, D = (16384, 4096) if big else (4096, 1024)
    H, K = (32, 128) if big else (16, 64)
    F = 14336 if big else 2816
    V, TV, DV = (151936, 8192, 4096) if big else (32000, 1024, 512)
    topk, E = 8, 64
    b = torch.tensor([], dtype=dtype).element_size()

    def rnd(*shape, grad=True, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt).requires_grad_(grad)

    def rms():
        x, w = rnd(T, D), rnd(D)
        return (x, w), (x, w)

    def add_rms():
        x, r, w = rnd(T, D), rnd(T, D), rnd(D)
        return (x, r, w), (x, r, w)

    def rot():
        x = rnd(T, H, K)
        cos, sin = reference.rotary_tables(torch.arange(T, device=device), K)
        return (x, cos, sin), (x,)

    def glu():
        g, u = rnd(T, F), rnd(T, F)
        return (g, u), (g, u)

    def lce():
        h, w = rnd(TV, DV), rnd(V, DV)
        labels = torch.randint(0, V, (TV,), device=device)
        return (h, w, labels), (h, w)

    def perm():
        x = rnd(T, D)
        experts = torch.randint(0, E, (T, topk), device=device)
        return (x, experts, E), (x,)

    def unperm():
        y = rnd(T * topk, D)
        order = torch.randperm(T * topk, device=device)
        w = rnd(T, topk, dt=torch.float32)
        return (y, order, w), (y, w)

    P = T * topk
    return {
        "rms_norm": (rms, (2 + 3) * T * D * b, None),
        "add_rms_norm": (add_rms, (4 + 4) * T * D * b, None),
        "rotary": (rot, (2 + 2) * T * H * K * b + 2 * T * K * 4, None),
        "swiglu": (glu, (3 + 5) * T * F * b, None),
        "linear_cross_entropy": (lce, None, 6 * TV * V * DV),
        "moe_permute": (perm, (T * D + P * D + P * D + T * D) * b, None),
        "moe_unpermute": (unperm, (P * D + T * D + T * D + 2 * P * D) * b, None),
    }


def fwd_bwd(fn, make):
    args, grads = make()

    def step():
        out = fn(*args)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
        for g in grads:
            g.grad = None
    return step


def timeit(steps: dict, device: str, warmup: int, reps: int) -> dict:
    """Median seconds per step of each implementation. Warm-up (compilation) first, then the
    implementations alternate rep by rep, so a busy machine's drift hits all of them alike."""
    def once(step):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    times, errors = {name: [] for name in steps}, {}
    for name, step in steps.items():
        try:
            for _ in range(warmup):
                step()
        except Exception as e:  # a compile failure is a result, not a crash
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    for _ in range(reps):
        for name, step in steps.items():
            if name not in errors:
                times[name].append(once(step))
    return {name: (statistics.median(t) if t else None) for name, t in times.items()}, errors


BACKENDS = ("reference", "eager", "compiled", "triton")  # triton on CUDA only


def implementations(op: str, device: str, backends: tuple[str, ...] = BACKENDS) -> dict:
    from omniscale.kernels import eager

    impls = {"reference": getattr(reference, op)}
    if hasattr(eager, op) and "eager" in backends:
        impls["eager"] = getattr(eager, op)
    if "compiled" in backends:
        impls["compiled"] = torch.compile(getattr(reference, op), dynamic=False)
    if device == "cuda" and "triton" in backends:
        import importlib

        from omniscale.kernels.triton_registry import TRITON_OPS
        module, name = TRITON_OPS[op].split(":")
        impls["triton"] = getattr(importlib.import_module(module), name)
    return impls


def run(device: str, ops: list[str], warmup: int, reps: int,
        backends: tuple[str, ...] = BACKENDS) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    table = cases(device, dtype)
    rows = []
    for op in ops:
        make, nbytes, flops = table[op]
        row = {"op": op, "dtype": str(dtype).removeprefix("torch.")}
        steps = {impl: fwd_bwd(fn, make)
                 for impl, fn in implementations(op, device, backends).items()}
        seconds, errors = timeit(steps, device, warmup, reps)
        row["ms"] = {impl: (1e3 * t if t else None) for impl, t in seconds.items()}
        if errors:
            row["errors"] = errors
        ms = row["ms"]
        row["speedup_vs_reference"] = {impl: ms["reference"] / t for impl, t in ms.items()
                                       if impl != "reference" and t and ms.get("reference")}
        if device == "cuda":
            for impl, t in ms.items():
                if t:
                    achieved = (nbytes / PEAK_BYTES_S if nbytes else flops / PEAK_FLOP_S)
                    row.setdefault("peak_fraction", {})[impl] = achieved / (t / 1e3)
            row["metric"] = "HBM bandwidth" if nbytes else "bf16 FLOP/s"
        rows.append(row)
        print_row(row, device)
    return rows


def print_row(row: dict, device: str) -> None:
    ms = "  ".join(f"{k} {v:8.2f} ms" if v else f"{k}   failed" for k, v in row["ms"].items())
    extra = ""
    if row.get("speedup_vs_reference"):
        extra += "  reference/" + " ".join(f"{k} {v:.2f}x"
                                           for k, v in row["speedup_vs_reference"].items())
    if device == "cuda" and "peak_fraction" in row:
        extra += "  " + " ".join(f"{k} {v:.0%}" for k, v in row["peak_fraction"].items()) + \
            f" of peak {row['metric']}"
    print(f"{row['op']:22s} fwd+bwd  {ms}{extra}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ops", default="", help="comma-separated subset (default: all; CPU: "
                    "rms_norm,add_rms_norm,rotary,swiglu,moe_permute,moe_unpermute)")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="comma-separated, the reference always runs (the quick check leaves "
                    "out compiled: torch.compile's C++ build is half a minute on a cold cache)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    default = (list(cases("cpu", torch.float32)) if args.device == "cuda" else
               ["rms_norm", "add_rms_norm", "rotary", "swiglu", "moe_permute", "moe_unpermute"])
    ops = args.ops.split(",") if args.ops else default
    if args.device == "cpu":
        torch.manual_seed(0)
    print(f"kernels benchmark on {args.device} "
          f"({torch.cuda.get_device_name() if args.device == 'cuda' else platform.machine()}, "
          f"{torch.get_num_threads()} threads): forward+backward, median of {args.reps}")
    started = provenance()
    backends = tuple(args.backends.split(","))
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        ap.error(f"--backends: {', '.join(unknown)} unknown (known: {', '.join(BACKENDS)})")
    rows = run(args.device, ops, args.warmup, args.reps, backends)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            **started, "command": " ".join(["tools/bench/kernel_ops.py", *sys.argv[1:]]),
            "device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "peak_bytes_s": PEAK_BYTES_S, "peak_flop_s": PEAK_FLOP_S, "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
