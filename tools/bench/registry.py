"""The registry of ``omniscale bench all``: every benchmark under tools/bench, the arguments it runs
with (quick, full, and a variant's own), the committed JSON it writes, and which numbers of that
JSON are its headlines -- a JSON path per column, so a bench's JSON keys and the tables built from
them (``bench all``'s, docs/benchmarks.md) cannot drift apart unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Goal:
    """A numeric target, checked on a row's ratio (or its value when it has no ratio)."""

    op: str  # ">=" or "<="
    bound: float

    def met(self, x: float) -> bool:
        return x >= self.bound if self.op == ">=" else x <= self.bound

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


# A ratio the bench does not write itself: baseline ÷ value (for times, where lower wins).
SPEEDUP = "baseline/value"


@dataclass(frozen=True)
class Metric:
    """One headline row (or one per item of the list at ``each``). ``value``, ``baseline``,
    ``ratio``, ``met`` and a string ``target`` are dotted paths into the bench's JSON (into the
    item with ``each``); a row whose value is absent is left out (CPU runs have no Triton)."""

    name: str  # str.format'ted with the item's fields when ``each`` is set
    value: str
    baseline: str | None = None
    ratio: str | None = None
    target: Goal | str | None = None
    met: str | None = None  # the bench's own verdict, when it writes one
    each: str | None = None
    where: tuple[str, object] | None = None  # only items whose field equals this


@dataclass(frozen=True)
class Bench:
    script: str
    metrics: tuple[Metric, ...]
    quick_args: tuple[str, ...] = ()
    quick_is_own_flag: bool = False  # False: quick_args shrink sizes, so targets are not judged
    missed_exit_code: int | None = None  # the exit status meaning "ran, some target missed"
    needs_cuda: bool = False
    json_in_out_dir: str | None = None  # a shell script writing this file under $OUT, no --out
    # the committed JSON under docs/bench (default NAME.json) and the arguments its figures are
    # measured with (`bench all --write-docs` runs them and writes it)
    docs_json: str | None = None
    full_args: tuple[str, ...] = ()
    # A variant: the same script as the bench named here, on another workload or setting, with
    # full_args saying which. Not run by --quick: its script's quick run is that bench's.
    variant_of: str | None = None


KERNEL_ROWS = (
    Metric("{op} fwd+bwd ms: eager (hand-written backward) vs reference", each="rows",
           value="ms.eager", baseline="ms.reference", ratio=SPEEDUP),
    Metric("{op} fwd+bwd ms: torch.compile vs reference", each="rows", value="ms.compiled",
           baseline="ms.reference", ratio=SPEEDUP),
    Metric("{op} fwd+bwd ms: Triton vs reference", each="rows", value="ms.triton",
           baseline="ms.reference", ratio=SPEEDUP),
    Metric("{op}: Triton fraction of peak {metric}", each="rows", value="peak_fraction.triton"),
)

LOADER_ROWS = (
    Metric("{workload} samples/s: RankLoader vs the faster of webdataset and "
           "Megatron-Energon (median of paired rounds)", each="workloads",
           value="ours.samples_per_s", baseline="baseline.samples_per_s",
           ratio="ratio.samples_per_s", target="target", met="met"),
    Metric("{workload} tokens/s: RankLoader vs the faster baseline (median of paired "
           "rounds)", each="workloads", value="ours.tokens_per_s",
           baseline="baseline.tokens_per_s", ratio="ratio.tokens_per_s"),
    Metric("{workload} samples/s: RankLoader vs DataLoader + webdataset",
           each="workloads", value="ours.samples_per_s",
           baseline="webdataset.samples_per_s",
           ratio="ratio_vs.webdataset.samples_per_s"),
    Metric("{workload} samples/s: RankLoader vs Megatron-Energon", each="workloads",
           value="ours.samples_per_s", baseline="energon.samples_per_s",
           ratio="ratio_vs.energon.samples_per_s"),
    # text: the baselines tokenize on every read, ours once at index time -- counted here
    Metric("{workload} samples/s with each sample's index time counted once (one process): "
           "RankLoader vs the faster baseline", each="workloads",
           value="ratio_with_index_cost.median", where=("workload", "text")),
    Metric("{workload}: reads of each sample after which RankLoader, its index time counted, "
           "is ahead of the faster baseline", each="workloads",
           value="break_even_reads.median", where=("workload", "text")),
    Metric("RSS growth MiB per worker, {kind}, {sources} sources",
           each="memory_per_worker", value="rss_growth_mib"),
)

# Every benchmark, in the order they run (cheapest first), and the headline numbers of each.
BENCHES: dict[str, Bench] = {
    "balance": Bench(
        "balance.py", quick_args=("--quick",), quick_is_own_flag=True,
        metrics=(Metric("{target}", each="targets", value="measured", target="goal", met="met"),)),
    "linear_ce_memory": Bench(
        "linear_ce_memory.py", quick_args=("--tokens", "2048", "--vocab", "32768",
                                           "--d-model", "256"),
        metrics=(
            Metric("peak RSS bytes: fused vs unfused linear CE", value="variants.fused.peak_bytes",
                   baseline="variants.unfused.peak_bytes", ratio="peak_ratio",
                   target=Goal("<=", 0.25)),
            Metric("RSS above inputs: fused vs unfused", value="variants.fused.loss_peak_bytes",
                   baseline="variants.unfused.loss_peak_bytes", ratio="loss_peak_ratio"),
            Metric("fused and unfused losses agree", value="losses_agree"))),
    "hf_load_memory": Bench(
        "hf_load_memory.py", quick_args=("--quick",), quick_is_own_flag=True,
        metrics=(
            Metric("peak RSS growth per rank loading a HF Qwen3-MoE: sharded vs from_hf then "
                   "fully_shard", value="median_peak_growth_bytes.sharded",
                   baseline="median_peak_growth_bytes.whole_then_shard",
                   ratio="sharded_over.whole_then_shard"),
            Metric("peak RSS growth per rank: sharded vs transformers from_pretrained",
                   value="median_peak_growth_bytes.sharded",
                   baseline="median_peak_growth_bytes.transformers",
                   ratio="sharded_over.transformers"),
            Metric("sharded load: peak bytes beyond the rank's shards",
                   value="sharded_beyond_shards_bytes"))),
    "kernels": Bench(
        "kernel_ops.py", quick_args=("--ops", "rms_norm", "--backends", "reference,eager",
                                     "--warmup", "1", "--reps", "2"),
        docs_json="kernels_cpu.json", full_args=("--device", "cpu"),
        metrics=KERNEL_ROWS),
    "model": Bench(
        "model.py", quick_args=("--presets", "tiny", "--tokens", "512", "--warmup", "1",
                                "--iters", "2"), full_args=("--warmup", "3", "--iters", "15"),
        metrics=(
            Metric("{preset} {batch}: tokens/s ours vs HF Qwen3-MoE", each="results",
                   value="ours_tokens_per_s", baseline="hf_tokens_per_s", ratio="ratio",
                   target=Goal(">=", 1.2), where=("batch", "equal")),
            # the headline: HF's fastest way to run the batch (either experts implementation;
            # on mixed lengths padded or bucketed too, whichever HF runs fastest)
            Metric("{preset} {batch}: ratio vs HF's fastest ({hf_best})", each="results",
                   value="ratio_vs_hf_best_default", target=Goal(">=", 1.2)),
            Metric("{preset} {batch}: tokens/s ours vs HF packed (block-causal)",
                   each="results", value="ours_tokens_per_s", baseline="hf_tokens_per_s",
                   ratio="ratio", where=("batch", "mixed")),
            Metric("{preset} {batch}: ratio vs HF padded (information)", each="results",
                   value="ratio_padded"),
            Metric("{preset} {batch}: ratio vs HF bucketed (information)", each="results",
                   value="ratio_bucketed"),
            Metric("{preset}: parameters, total", each="results", value="params_total",
                   where=("batch", "equal")),
            Metric("{preset}: parameters, active per token", each="results",
                   value="params_active", where=("batch", "equal")))),
    "attention": Bench(
        "attention.py", quick_args=("--reps", "3", "--cases", "tiny 4x512,small 4x512"),
        docs_json="attention_cpu.json",
        metrics=(Metric("{case} fwd+bwd ms: blocked vs SDPA", each="rows", value="ms.blocked",
                        baseline="ms.sdpa", ratio="speedup"),)),
    "commit": Bench(
        "commit.py", quick_args=("--ranks", "64", "--steps", "2"),
        metrics=(Metric("a step's rank commits, fsync +{fsync_extra_ms} ms: group commit vs "
                        "an fsync per record (s)", each="rows", value="group_commit_s",
                        baseline="fsync_each_s", ratio="speedup"),)),
    "loader": Bench(
        "loader.py", quick_args=("--steps", "2", "--rounds", "1", "--workers", "1", "--sources",
                                 "10", "--workloads", "mixed"),
        metrics=LOADER_ROWS),
    "ray_loader": Bench(
        "ray_loader.py", quick_args=("--steps", "2", "--rounds", "1", "--workers", "1"),
        metrics=(
            Metric("samples/s: Ray decoding pools vs DataLoader workers (median of rounds)",
                   value="median.ray.samples_per_s",
                   baseline="median.workers.samples_per_s", ratio="ratio.median"),
            Metric("loader start to the first step, s: Ray pools vs DataLoader workers",
                   value="median.ray.start_s", baseline="median.workers.start_s"))),
    "remote": Bench(
        "remote.py", quick_args=("--steps", "2", "--rounds", "1", "--workers", "1",
                                 "--latency-ms", "20", "--scale", "tiny"),
        metrics=(
            Metric("samples/s from a local S3 server at 20 ms/request, cold cache + plan "
                   "prefetch vs local disk (median of rounds)", each="latencies",
                   where=("latency_ms", 20.0), value="cold.samples_per_s",
                   baseline="local.samples_per_s", ratio="cold.ratio.median",
                   target=Goal(">=", 0.9)),
            Metric("samples/s from a local S3 server at {latency_ms:g} ms/request, no cache vs "
                   "local disk", each="latencies", value="direct.samples_per_s",
                   baseline="local.samples_per_s", ratio="direct.ratio.median"),
            Metric("samples/s from a local S3 server at {latency_ms:g} ms/request, warm cache "
                   "vs local disk", each="latencies", value="warm.samples_per_s",
                   baseline="local.samples_per_s", ratio="warm.ratio.median"))),
    "plane": Bench(
        # its own --quick, and shorter still: memory at 1 and 2 processes a side, serving 0.5 s
        # of 32 clients in 2 processes for the two transports PlaneClient has, planning 1,024
        # ranks only; the Energon peer is left out (tests/tools/test_bench_plane_energon.py runs it)
        "plane.py", quick_args=("--quick", "--memory-procs", "1,2", "--seconds", "0.5",
                                "--warmup", "0.2", "--clients", "32", "--procs", "2",
                                "--modes", "action,lane", "--plan-ranks", "1024", "--no-peer"),
        missed_exit_code=1,
        metrics=(Metric("{what}", each="rows", value="value", baseline="baseline",
                        target="target", met="met"),)),
    "e2e": Bench(
        # quick: one run of the turns (--rotations 1): the policies on different windows
        "e2e.py", quick_args=("--rounds", "1", "--rotations", "1", "--window", "1", "--cycles",
                              "1", "--warmup", "0",
                              "--scale", "tiny", "--policies", "omniscale,token_lpt", "--costs",
                              "flops",
                              "--global-batch-tokens", "4096", "--micro-batch-tokens", "2048",
                              "--workers", "0"),
        # the policies in turns inside each run (e2e.py's default schedule): this machine's
        # speed drifts by up to 1.7x over tens of seconds, more than whole runs' differences
        full_args=("--rounds", "3", "--cycles", "2", "--wait-quiet-s", "60"),
        metrics=(
            Metric("training tokens/s: ours vs the best baseline policy (median of rounds)",
                   value="median.omniscale.tokens_per_s", ratio="ratio_vs_best_baseline.median",
                   target=Goal(">=", 0.98)),  # issue #44: never slower than the best baseline
            Metric("measured imbalance (compute clock) of our plans",
                   value="median.omniscale.imbalance_measured", target=Goal("<=", 1.10)))),
    "e2e_long_tail": Bench(
        # quick: the default schedule (the policies in turns), one window of 1 each, in one run
        # (--rotations 1: the policies on different windows)
        "e2e_long_tail.py", quick_args=("--rounds", "1", "--rotations", "1", "--window", "1",
                                        "--warmup", "0",
                                        "--workers", "0",
                                        "--scale", "tiny", "--costs", "flops", "--policies",
                                        "omniscale,static_sp", "--retries", "0",
                                        "--wait-quiet-s", "0"),
        full_args=("--rounds", "2", "--costs", "calibrate", "--wait-quiet-s", "60"),
        metrics=(  # issue #44 item 3
            Metric("long-tailed training tokens/s, the policies in turns: ours vs the static SP "
                   "layout (median of rounds)", value="median.omniscale.tokens_per_s_real",
                   baseline="median.static_sp.tokens_per_s_real",
                   ratio="measured.ratio_vs_static.median", target=Goal(">=", 1.2)),
            Metric("long-tailed training tokens/s, the policies in turns: ours vs the best "
                   "per-step baseline given our split (median of rounds)",
                   value="median.omniscale.tokens_per_s_real",
                   ratio="measured.ratio_vs_best_per_step.median", target=Goal(">=", 1.0)))),
    "gpu_check": Bench(
        "gpu_check.sh", needs_cuda=True, json_in_out_dir="kernels_h200.json",
        docs_json="kernels_h200.json",
        metrics=KERNEL_ROWS),
    # -- variants: committed JSONs the docs cite that a bench above writes with other arguments
    "e2e_uneven": Bench(
        # issue #44, item 2: one rank slowed from a given step by a process spinning on its core
        "e2e.py", variant_of="e2e",
        full_args=("--workload", "uneven", "--rounds", "3", "--policies",
                   "omniscale,token_lpt,kk_cost", "--wait-quiet-s", "60"),
        metrics=(
            Metric("uneven ranks, tokens/s: ours vs the best baseline (median of rounds)",
                   value="median.omniscale.tokens_per_s", ratio="ratio_vs_best_baseline.median",
                   target=Goal(">=", 1.35)),
            Metric("uneven ranks: ours as a fraction of the speed-proportional split's "
                   "tokens/s", value="median.omniscale.ideal_fraction", target=Goal(">=", 0.9)),
            Metric("uneven ranks: measured imbalance of our plans",
                   value="median.omniscale.imbalance_measured", target=Goal("<=", 1.10)),
            Metric("uneven ranks: steps from the slowdown to the first step planned for it",
                   value="median.omniscale.planned_for_slowdown_after_steps",
                   target=Goal("<=", 5)),
            Metric("uneven ranks: steps from the release to the first step planned for it",
                   value="median.omniscale.planned_for_release_after_steps",
                   target=Goal("<=", 5)))),
    "e2e_uneven_turns": Bench(
        # the same workload with the policies in turns inside each run (e2e_uneven.turns_round):
        # paired on the same steps at interleaved times, where whole runs minutes apart were
        # paired across this machine's drift
        "e2e.py", variant_of="e2e",
        full_args=("--workload", "uneven", "--schedule", "interleaved", "--rounds", "3",
                   "--policies", "omniscale,token_lpt,kk_cost", "--wait-quiet-s", "60"),
        metrics=(
            Metric("uneven ranks, the policies in turns, tokens/s: ours vs the best baseline "
                   "(median of rounds)", value="median.omniscale.tokens_per_s",
                   ratio="ratio_vs_best_baseline.median", target=Goal(">=", 1.35)),
            Metric("uneven ranks, in turns: ours as a fraction of the speed-proportional "
                   "split's tokens/s", value="median.omniscale.ideal_fraction",
                   target=Goal(">=", 0.9)),
            Metric("uneven ranks, in turns: measured imbalance of our plans",
                   value="median.omniscale.imbalance_measured", target=Goal("<=", 1.10)),
            Metric("uneven ranks, in turns: steps from the slowdown to the step the plane "
                   "plans with the new speeds from",
                   value="median.omniscale.speeds_applied_after_slowdown_steps",
                   target=Goal("<=", 5)))),
    "e2e_no_reshard": Bench(
        "e2e.py", variant_of="e2e",
        full_args=("--rounds", "2", "--policies", "omniscale,token_lpt", "--no-reshard"),
        metrics=(Metric("media encoded on the rank that consumes it (no reshard), tokens/s: "
                        "ours vs the best baseline (median of rounds)",
                        value="median.omniscale.tokens_per_s",
                        ratio="ratio_vs_best_baseline.median"),)),
    "loader_image": Bench(
        "loader.py", variant_of="loader", full_args=("--workloads", "image", "--sources", "10"),
        metrics=LOADER_ROWS),
    "balance_scale": Bench(
        "balance.py", variant_of="balance", full_args=("--scale",),
        metrics=(Metric("{target}", each="targets", value="measured", target="goal",
                        met="met"),)),
    "plane_scale": Bench(
        "plane.py", variant_of="plane", missed_exit_code=1,
        full_args=("--planning-only", "--plan-ranks", "1024,4096,16384"),
        metrics=(Metric("{what}", each="rows", value="value", baseline="baseline",
                        target="target", met="met"),)),
    "plane_ramp": Bench(
        # a curriculum over tokens (every draw moves the mixture), at the sizes of plane's own
        "plane.py", variant_of="plane", missed_exit_code=1,
        full_args=("--planning-only", "--plan-ranks", "1024,4096", "--plan-schedule",
                   "const,tokens-ramp"),
        metrics=(Metric("{what}", each="rows", value="value", baseline="baseline",
                        target="target", met="met"),)),
}
