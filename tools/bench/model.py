"""Forward+backward tokens/s of our MoE decoder against Hugging Face transformers' Qwen3-MoE
built with the same shapes, on the same batch, in the same run.

    .venv/bin/python tools/bench/model.py --out docs/bench/model.json

Fairness. Both models get the same parameter count (checked; `params_total` and
`params_active`, the parameters one token touches with embeddings, are in the table and the
JSON), the same dtype, the same tokens and a loss that includes the router's auxiliary loss
(HF: `output_router_logits=True`), and both are run with their defaults otherwise (HF: SDPA
attention and its default experts implementation, `grouped_mm` in transformers 5.x; ours: the
kernel registry's CPU choice, kernels.describe("cpu")). HF is also timed with its per-expert
loop (`--hf-experts`, default `grouped_mm,eager`): `ratio` is against HF's default,
`ratio_vs_hf_best_<ours>` (the headline) against HF's fastest way to run the batch: either
experts implementation and, on mixed lengths, padded or bucketed too (`hf_best` names it).
Two batches:
- `equal`: S sequences of the same length L. HF gets them as a [S, L] batch (no padding, no
  mask, SDPA's fused causal kernel), we get them packed with cu_seqlens: identical FLOPs.
- `mixed`: the same number of tokens in sequences of varied lengths (1024, 512, 256, 128, 128).
  We pack them. HF's headline (`ratio`, `hf_tokens_per_s`) is its own packed format, what
  transformers' DataCollatorWithFlattening produces: one row [1, T], `position_ids` restarting
  at 0 per sequence, no attention_mask, the label of each sequence's first token -100. From
  the position_ids transformers (masking_utils.find_packed_sequence_indices) builds a
  block-diagonal causal mask, so each token attends only within its sequence: the bench checks
  this once per mixed row (HF packed logits against HF run on each sequence alone,
  `hf_packed_check`). The linear work is then identical to ours; attention is not quite: on
  CPU (no flash-attn) SDPA gets the mask as a dense [T, T] tensor and computes the masked-out
  scores too, which is what HF's packed path costs there. Information rows: `padded` (pad to
  the longest and mask, `ratio_padded`: 2.5x the tokens here) and `bucketed` (one
  forward+backward per group of equal-length sequences, gradients accumulated, loss weighted
  by tokens, `ratio_bucketed`), both with HF's default experts implementation; either can be
HF's fastest, and then it is the headline's baseline.
Presets: the backbone's (`tiny` 1.1 M parameters, `small` 17 M) and `medium`, defined here
only (140 M total, 52 M active: 8 layers of 32 experts, top-4, a 32K vocabulary), which is no
toy on CPU; a preset of 100 M parameters or more runs `--warmup-large` + `--iters-large` steps
instead of `--warmup` + `--iters` (each row records its own).
Steps alternate between the models after the warm-up, so drift hits both equally, and the
median step time is reported (robust to other processes on a shared machine). The JSON
records where the figures come from (tools/bench/provenance.py: commit, dirty tree, load
average at the start, CPUs) and the command line.

Our kernels. `--ours default,compiled` measures our model once per kernel choice in the same
alternation: `default` is the registry's automatic CPU choice (`kernels.describe("cpu")`:
the blocked causal attention, the chunked linear cross-entropy, norms and rotary with hand-written
backward), `compiled` is `ModelConfig(kernels={"*": "compiled"})`, the torch.compile'd CPU
backends of kernels/compiled.py for the ops that have one (rms_norm, add_rms_norm, rotary,
swiglu, moe_unpermute; README, Kernels); HF stays eager (it has no such switch). `ratio` is the
first variant's, `ratio_<variant>` each one's; the JSON records the backend of every op
(`our_kernels`) and HF's attention and experts implementations. `--compile-blocks` instead
wraps every decoder layer of both models in `torch.compile` (same treatment both sides;
compile time is not timed).

    .venv/bin/python tools/bench/model.py --ours default,compiled --out docs/bench/model.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from omniscale.backbone.config import KERNEL_OPS, ModelConfig, MoEConfig, kernel  # noqa: E402
from omniscale.backbone.decoder import MoEDecoder  # noqa: E402
from omniscale.kernels import backend_of  # noqa: E402
from omniscale.tools.bench.provenance import provenance  # noqa: E402

MIXED_FRACTIONS = (0.5, 0.125, 0.25, 0.0625, 0.0625)  # of the total, longest first
LARGE = 100_000_000  # parameters from which a preset runs --warmup-large + --iters-large steps
PACKED_ATOL = 1e-3  # HF packed vs per-sequence logits (fp32; a near-tie in top-k can flip)

# Presets defined only here: ModelConfig.preset's `small` (17 M) is a toy on CPU, `1b` too slow.
BENCH_PRESETS = {
    "medium": lambda: ModelConfig(
        vocab_size=32768, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64,
        ffn_dim=1536, moe=MoEConfig(num_experts=32, top_k=4, expert_ffn_dim=256)),
}


def preset_config(name: str, **overrides) -> ModelConfig:
    if name in BENCH_PRESETS:
        return dataclasses.replace(BENCH_PRESETS[name](), **overrides)
    return ModelConfig.preset(name, **overrides)


def hf_model(config: ModelConfig, dtype: torch.dtype, experts: str | None = None):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    m = config.moe
    hf_config = Qwen3MoeConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model,
        intermediate_size=config.ffn_dim, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim, num_experts=m.num_experts, num_experts_per_tok=m.top_k,
        moe_intermediate_size=m.expert_ffn_dim, norm_topk_prob=m.norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=list(range(config.n_dense_layers)),
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        output_router_logits=True, router_aux_loss_coef=m.aux_loss_coef,
        max_position_embeddings=65536, attn_implementation="sdpa")
    model = Qwen3MoeForCausalLM(hf_config).to(dtype)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


def kernels_used(config: ModelConfig) -> dict[str, str]:
    """The backend our model runs each op on, on CPU (as the model resolves them)."""
    used = {op: getattr(kernel(op, "cpu", config.kernel_backend(op)), "_omniscale_backend")
            for op in KERNEL_OPS}
    used["varlen_attention"] = backend_of("varlen_attention", "cpu", config.attention_backend)
    return used


def lengths_for(kind: str, total: int, n_seqs: int) -> list[int]:
    if kind == "equal":
        return [total // n_seqs] * n_seqs
    lengths = [max(1, int(total * f)) for f in MIXED_FRACTIONS]
    lengths[-1] += total - sum(lengths)
    return lengths


def our_step(model: MoEDecoder, ids_T, pos_T, cu_S1, max_len, labels_T):
    hidden_TD, aux = model(model.embed_tokens(ids_T), pos_T, cu_S1, max_len)
    loss_sum, n = model.loss(hidden_TD, labels_T)
    (loss_sum / n + aux["router_loss"]).backward()
    model.zero_grad(set_to_none=True)


def hf_step(model, ids_BL, mask_BL, labels_BL):
    out = model(input_ids=ids_BL, attention_mask=mask_BL, labels=labels_BL, use_cache=False)
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def hf_packed_step(model, ids_1T, pos_1T, labels_1T):
    """HF's packed format (DataCollatorWithFlattening): no attention_mask, position_ids
    restarting per sequence, from which transformers builds the block-causal mask."""
    out = model(input_ids=ids_1T, position_ids=pos_1T, labels=labels_1T, use_cache=False)
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def hf_bucketed_step(model, buckets):
    """One forward+backward per bucket of equal-length sequences; the summed losses equal the
    token-weighted mean over the whole batch."""
    total = sum(int((labels[:, 1:] != -100).sum()) for _, labels in buckets)
    for ids_BL, labels_BL in buckets:
        n = int((labels_BL[:, 1:] != -100).sum())
        out = model(input_ids=ids_BL, labels=labels_BL, use_cache=False)
        (out.loss * n / total).backward()
    model.zero_grad(set_to_none=True)


def buckets_of(lengths: list[int], ids_BL: torch.Tensor):
    by_length: dict[int, list[int]] = {}
    for b, n in enumerate(lengths):
        by_length.setdefault(n, []).append(b)
    return [(ids_BL[rows, :n], ids_BL[rows, :n]) for n, rows in by_length.items()]


def batches(lengths: list[int], vocab: int, seed: int = 0):
    """Our packed batch, HF's padded one (a plain [S, L] batch when the lengths are equal)
    and HF's packed one, holding the same token ids and predicting the same tokens."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    ids_T = torch.cat(seqs)
    pos_T = torch.cat([torch.arange(n) for n in lengths])
    cu_S1 = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    labels_T = torch.cat([torch.cat([s[1:], torch.tensor([-100])]) for s in seqs])
    L = max(lengths)
    ids_BL = torch.zeros(len(lengths), L, dtype=torch.long)
    mask_BL = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids_BL[b, :len(s)], mask_BL[b, :len(s)] = s, 1
    equal = len(set(lengths)) == 1
    labels_BL = ids_BL.masked_fill(mask_BL == 0, -100)  # HF shifts labels itself
    # HF packed: HF shifts across the row, so each sequence's first label is the separator
    # (-100): the last token of one sequence does not predict the next one's first.
    labels_1T = ids_T.clone()
    labels_1T[cu_S1[:-1].long()] = -100
    ours = (ids_T, pos_T, cu_S1, L, labels_T)
    padded = (ids_BL, None if equal else mask_BL, labels_BL)
    packed = (ids_T[None], pos_T[None], labels_1T[None])
    return ours, padded, packed


@torch.no_grad()
def hf_packed_check(model, lengths: list[int], packed) -> float:
    """Max |logit difference| between HF on the packed row and HF on each sequence alone:
    ~1e-6 when transformers confines attention to each sequence, O(1) if it does not."""
    ids_1T, pos_1T, _ = packed
    whole = model(input_ids=ids_1T, position_ids=pos_1T, use_cache=False,
                  output_router_logits=False).logits[0]
    diff, start = 0.0, 0
    for n in lengths:
        alone = model(input_ids=ids_1T[:, start:start + n], use_cache=False,
                      output_router_logits=False).logits[0]
        diff = max(diff, float((whole[start:start + n] - alone).abs().max()))
        start += n
    return diff


OUR_KERNELS = {"default": None, "compiled": {"*": "compiled"}}


def compile_blocks(layers: torch.nn.ModuleList) -> None:
    """Wrap every decoder layer in torch.compile (graph breaks allowed: our attention and
    expert loop read cu_seqlens / expert counts on the host)."""
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer)


def human(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def measure(preset: str, kind: str, args, dtype: torch.dtype) -> dict:
    variants = args.ours.split(",")
    ours = {}
    for variant in variants:
        config = preset_config(preset, kernels=OUR_KERNELS[variant])
        torch.manual_seed(0)
        ours[variant] = MoEDecoder(config).to(dtype)
    hf_variants = args.hf_experts.split(",") if args.hf_experts else [None]
    hf_models = {("hf" if i == 0 else f"hf_{v}"): hf_model(config, dtype, v)
                 for i, v in enumerate(hf_variants)}
    theirs = hf_models["hf"]
    if args.compile_blocks:
        for model in ours.values():
            compile_blocks(model.layers)
        for model in hf_models.values():
            compile_blocks(model.model.layers)
    n_ours = sum(p.numel() for p in ours[variants[0]].parameters())
    n_hf = sum(p.numel() for p in theirs.parameters())
    if n_ours != n_hf:
        print(f"warning: {preset}: {n_ours:,} parameters here vs {n_hf:,} in HF's build",
              file=sys.stderr)
    large = n_ours >= LARGE
    warmup, iters = (args.warmup_large, args.iters_large) if large else (args.warmup, args.iters)
    lengths = lengths_for(kind, args.tokens, args.n_seqs)
    our_batch, hf_padded, hf_packed = batches(lengths, config.vocab_size)
    equal = kind == "equal"
    packed_diff = None
    if not equal:  # HF's packed path must keep attention within each sequence (docstring)
        packed_diff = hf_packed_check(theirs, lengths, hf_packed)
        if not packed_diff <= PACKED_ATOL:
            raise RuntimeError(f"{preset}: HF packed logits differ from per-sequence ones by "
                               f"{packed_diff:.3g} (> {PACKED_ATOL}): attention crosses "
                               "sequences, the packed baseline would be wrong")
    runs = {f"ours_{v}": (lambda m=m: our_step(m, *our_batch)) for v, m in ours.items()}
    for name, model in hf_models.items():  # equal: [S, L]; mixed: HF packed [1, T]
        runs[name] = ((lambda m=model: hf_step(m, *hf_padded)) if equal
                      else (lambda m=model: hf_packed_step(m, *hf_packed)))
    if not equal:  # information: HF's default experts implementation, padded and bucketed
        buckets = buckets_of(lengths, hf_padded[0])
        runs["hf_padded"] = lambda: hf_step(theirs, *hf_padded)
        runs["hf_bucketed"] = lambda: hf_bucketed_step(theirs, buckets)
    for _ in range(warmup):
        for run in runs.values():
            run()
    step_times = {name: [] for name in runs}
    for _ in range(iters):  # alternate, so load drift hits every run alike
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            step_times[name].append(time.perf_counter() - t0)
    # the median step: robust to other processes stealing the (shared, 2-core) CPU
    seconds = {name: statistics.median(times) for name, times in step_times.items()}
    tokens = sum(lengths)
    first = f"ours_{variants[0]}"
    # HF's strongest way to run this batch: either experts implementation, and on mixed
    # lengths also padded or bucketed (one pass per length), whichever is fastest here
    hf_ways = [*hf_models, *(w for w in ("hf_padded", "hf_bucketed") if w in seconds)]
    hf_best = min(hf_ways, key=lambda name: seconds[name])
    our_config = ours[variants[0]].config
    result = {"preset": preset, "batch": kind, "lengths": lengths, "dtype": str(dtype),
              "params_total": our_config.param_count(),
              "params_active": our_config.active_param_count(),
              "params_ours": n_ours, "params_hf": n_hf,
              "warmup": warmup, "iters": iters,
              "hf_layout": (f"[{len(lengths)}, {lengths[0]}] batch, no mask" if equal else
                            f"packed [1, {tokens}], position_ids per sequence, block-causal"),
              "hf_packed_check": (None if equal else
                                  {"max_abs_logit_diff": packed_diff, "atol": PACKED_ATOL}),
              "hf_attn_implementation": theirs.config._attn_implementation,
              "hf_experts_implementation": theirs.config._experts_implementation,
              "hf_variants": {name: m.config._experts_implementation
                              for name, m in hf_models.items()},
              "our_kernels": {v: kernels_used(m.config) for v, m in ours.items()},
              "compile_blocks": args.compile_blocks,
              "step_seconds_all": step_times,
              **{f"{name}_tokens_per_s": tokens / t for name, t in seconds.items()},
              "ours_tokens_per_s": tokens / seconds[first],
              "ratio": seconds["hf"] / seconds[first],
              "hf_best": hf_best, "hf_best_tokens_per_s": tokens / seconds[hf_best],
              "ratio_vs_hf_best": seconds[hf_best] / seconds[first]}
    for v in variants:
        result[f"ratio_{v}"] = seconds["hf"] / seconds[f"ours_{v}"]
        result[f"ratio_vs_hf_best_{v}"] = seconds[hf_best] / seconds[f"ours_{v}"]
        # per alternation round (same load for both): the median of hf/ours step ratios
        result[f"ratio_paired_{v}"] = statistics.median(
            h / o for h, o in zip(step_times["hf"], step_times[f"ours_{v}"]))
        for info in ("padded", "bucketed"):
            if f"hf_{info}" in seconds:
                result[f"ratio_{info}_{v}"] = seconds[f"hf_{info}"] / seconds[f"ours_{v}"]
    for info in ("padded", "bucketed"):
        if f"hf_{info}" in seconds:
            result[f"ratio_{info}"] = seconds[f"hf_{info}"] / seconds[first]
    layout = "" if equal else "packed "
    line = (f"{preset:6s} {kind:6s} {str(dtype)[6:]:8s} {human(result['params_total'])} params, "
            f"{human(result['params_active'])} active, {warmup} + {iters} steps"
            f"{'  blocks compiled' if args.compile_blocks else ''}\n"
            f"    HF Qwen3-MoE ({theirs.config._attn_implementation}, "
            f"{theirs.config._experts_implementation}) {layout}{tokens / seconds['hf']:7.0f} "
            "tok/s")
    for name, model in list(hf_models.items())[1:]:
        line += (f"\n    HF Qwen3-MoE ({model.config._experts_implementation}) {layout}"
                 f"{tokens / seconds[name]:7.0f} tok/s")
    if not equal:
        line += (f"\n    HF ({theirs.config._experts_implementation}) padded "
                 f"{tokens / seconds['hf_padded']:7.0f} tok/s, bucketed "
                 f"{tokens / seconds['hf_bucketed']:7.0f} tok/s (information); packed logits "
                 f"= per-sequence ones within {packed_diff:.1e}")
    for v in variants:
        line += (f"\n    ours ({v:8s}) {tokens / seconds[f'ours_{v}']:7.0f} tok/s   ratio "
                 f"{result[f'ratio_{v}']:.2f} (paired median {result[f'ratio_paired_{v}']:.2f})")
        line += f"   vs fastest HF ({hf_best}) {result[f'ratio_vs_hf_best_{v}']:.2f}"
        if not equal:
            line += (f"   vs padded {result[f'ratio_padded_{v}']:.2f}, bucketed "
                     f"{result[f'ratio_bucketed_{v}']:.2f}")
    print(line, flush=True)
    return result


def summary(results: list[dict]) -> str:
    """The printed table: one row per preset and batch, ratios of our first variant."""
    rows = ["| preset | params total | active | batch | HF input | ours tok/s | HF tok/s | "
            "ratio | vs fastest HF | vs padded | vs bucketed |", "|" + "---|" * 11]
    for r in results:
        info = [f"{r[k]:.2f}" if k in r else "-" for k in ("ratio_padded", "ratio_bucketed")]
        lengths = "+".join(map(str, r["lengths"]))
        rows.append(f"| {r['preset']} | {human(r['params_total'])} | "
                    f"{human(r['params_active'])} | {r['batch']} {lengths} | {r['hf_layout']} | "
                    f"{r['ours_tokens_per_s']:.0f} | "
                    f"{r['hf_tokens_per_s']:.0f} | {r['ratio']:.2f} | "
                    f"{r['ratio_vs_hf_best']:.2f} | {info[0]} | {info[1]} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="tiny,small,medium",
                   help=f"ModelConfig presets or this bench's ({', '.join(BENCH_PRESETS)})")
    p.add_argument("--batches", default="equal,mixed")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step")
    p.add_argument("--n-seqs", type=int, default=4, help="sequences in the equal batch")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup-large", type=int, default=1,
                   help=f"warm-up steps of presets with >= {LARGE:,} parameters")
    p.add_argument("--iters-large", type=int, default=3,
                   help=f"timed steps of presets with >= {LARGE:,} parameters")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ours", default="default",
                   help=f"our kernel choices, comma-separated ({', '.join(OUR_KERNELS)})")
    p.add_argument("--hf-experts", default="grouped_mm,eager",
                   help="HF experts implementations to time, comma-separated; the first is "
                        "`ratio`'s baseline, the fastest `ratio_vs_hf_best_*`'s")
    p.add_argument("--compile-blocks", action="store_true",
                   help="torch.compile every decoder layer, ours and HF's")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    unknown = set(args.ours.split(",")) - set(OUR_KERNELS)
    if unknown:
        p.error(f"--ours: unknown {sorted(unknown)} (known: {', '.join(OUR_KERNELS)})")
    try:
        import transformers
    except ImportError:
        print("tools/bench/model.py: Hugging Face transformers is not installed; it is the "
              "baseline. Install the bench extra: pip install -e .[bench]", file=sys.stderr)
        return 2
    started = provenance()
    command = "tools/bench/model.py " + " ".join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} threads, {args.tokens} tokens/step, {args.warmup} warm-up + "
          f"{args.iters} timed steps each (fwd+bwd; presets >= {LARGE / 1e6:.0f} M parameters: "
          f"{args.warmup_large} + {args.iters_large}); same parameter count both sides")
    results = [measure(preset, kind, args, dtype) for preset in args.presets.split(",")
               for kind in args.batches.split(",")]
    print(summary(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": platform.processor() or platform.machine(), "threads": args.threads,
            "tokens_per_step": args.tokens, "warmup": args.warmup, "iters": args.iters,
            "warmup_large": args.warmup_large, "iters_large": args.iters_large,
            "command": command, **started,
            "load_average_after": list(os.getloadavg()),
            "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
