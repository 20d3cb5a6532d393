"""``omniscale balance simulate``: our planner against the baselines on the same global batches.

Options are checked up front (every bad value is one UserError line), the samples come from a
lengths file or a built-in generator, every policy plans the same steps, and the comparison is
printed as a table (or JSON), optionally drawn (per-rank load per step for each policy) and
our plan written as one Parquet row per placement. The baselines run twice, without the
long-short split (labelled "no split") and with ours (``+split``); the SP all-to-all and the
encoder reshard are charged to every policy from ``--bandwidth`` and the model shape
(`balancer.cost.CommModel`). The headline ratio is against the best baseline that may split.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from omniscale.balancer.cost import CommModel
from omniscale.balancer.cost_file import costs_of
from omniscale.balancer.simulate import (
    ALL_POLICIES,
    OURS,
    OURS_STEP_SYNC,
    PolicyRun,
    compare,
    judged,
    rank_loads,
    run_policy,
)
from omniscale.balancer.split import largest_sp_size
from omniscale.balancer.types import PlannerConfig, WindowSamples
from omniscale.errors import UserError
from omniscale.tools.balance_input import drawn_stream, load_lengths, rank_speeds, step_offsets
from omniscale.tools.train.cost_model import read_cost_file

DEFAULT_STEPS = 16
DEFAULT_SAMPLES_PER_RANK = 8


@dataclass(frozen=True)
class SimOptions:
    lengths: Path | None
    dist: str | None
    config: PlannerConfig
    alpha: float
    beta: float
    comm: CommModel
    steps: int | None
    samples_per_rank: int | None
    global_batch_tokens: int | None
    seed: int
    json: bool
    plot: Path | None
    plan_out: Path | None
    costs_file: Path | None = None  # a calibrated cost file: replaces alpha, beta and comm


def options_from_args(args: argparse.Namespace) -> SimOptions:
    """The validated options; a UserError naming the first bad flag."""
    if (args.lengths is None) == (args.dist is None):
        raise UserError("give exactly one of --lengths FILE and --dist NAME")
    if args.samples_per_rank is not None and args.global_batch_tokens is not None:
        raise UserError("give at most one of --samples-per-rank and --global-batch-tokens")
    for flag in ("dp", "window", "micro_batch_tokens", "sp_max", "steps", "samples_per_rank",
                 "global_batch_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')}: must be >= 1, got {value}")
    if args.sp_max & (args.sp_max - 1):
        raise UserError(f"--sp-max: must be a power of two, got {args.sp_max}")
    if not 0 <= args.epsilon < 1:
        raise UserError(f"--epsilon: must be in [0, 1), got {args.epsilon}")
    if args.cost_linear < 0 or args.cost_quadratic < 0 or \
            args.cost_linear + args.cost_quadratic == 0:
        raise UserError("--cost-linear, --cost-quadratic: must be >= 0 and not both 0")
    if args.seed < 0:
        raise UserError(f"--seed: must be >= 0, got {args.seed}")
    if not args.bandwidth > 0:  # NaN fails too
        raise UserError(f"--bandwidth: must be > 0 GB/s (inf: free), got {args.bandwidth}")
    for flag in ("hidden_size", "layers", "dtype_bytes", "unit_seconds"):
        value = getattr(args, flag)
        if not value > 0 or math.isinf(value):
            raise UserError(f"--{flag.replace('_', '-')}: must be > 0, got {value}")
    per_rank = args.samples_per_rank
    if per_rank is None and args.global_batch_tokens is None:
        per_rank = DEFAULT_SAMPLES_PER_RANK
    try:
        config = PlannerConfig(dp=args.dp, micro_batch_tokens=args.micro_batch_tokens,
                               window=args.window, sp_max=args.sp_max, epsilon=args.epsilon,
                               rank_speed=rank_speeds(args.rank_speeds))
    except ValueError as e:  # the speeds: one per rank, each finite and > 0
        raise UserError(f"--rank-speeds {args.rank_speeds}: {e}") from None
    return SimOptions(
        lengths=Path(args.lengths) if args.lengths else None, dist=args.dist,
        config=config,
        alpha=args.cost_linear, beta=args.cost_quadratic,
        comm=CommModel(hidden=args.hidden_size, layers=args.layers,
                       dtype_bytes=args.dtype_bytes, bandwidth=args.bandwidth * 1e9,
                       unit_seconds=args.unit_seconds),
        steps=args.steps,
        samples_per_rank=per_rank, global_batch_tokens=args.global_batch_tokens,
        seed=args.seed, json=args.json, plot=Path(args.plot) if args.plot else None,
        plan_out=Path(args.plan_out) if args.plan_out else None,
        costs_file=Path(args.costs) if args.costs else None)


def default_costs(alpha: float, beta: float, comm: CommModel | None = None):
    """LLM cost ``α·L + β·L²``; encoders priced relative to it (Costs.from_llm); the two
    collectives priced by ``comm`` (free when None)."""
    from omniscale.balancer.cost import Costs

    return Costs.from_llm(alpha, beta, **(comm.collectives() if comm is not None else {}))


def comm_json(comm: CommModel) -> dict:
    """CommModel.describe() with an infinite bandwidth as null (JSON has no infinity)."""
    d = comm.describe()
    if math.isinf(d["bandwidth_bytes_per_s"]):
        d["bandwidth_bytes_per_s"] = None
    return d


def bandwidth_label(bandwidth: float) -> str:
    """25 GB/s, or free for an infinite bandwidth (bytes/s in)."""
    return "free" if math.isinf(bandwidth) else f"{bandwidth / 1e9:g} GB/s"


def samples_for(options: SimOptions) -> tuple[WindowSamples, np.ndarray, np.ndarray]:
    """(stream, step offsets, file row of each sample), checked against the SP capacity."""
    per_step = (options.samples_per_rank * options.config.dp
                if options.samples_per_rank is not None else None)
    if options.lengths is not None:
        stream, row_N = load_lengths(options.lengths)
        offsets_S1 = step_offsets(stream.tokens_N, per_step, options.global_batch_tokens,
                                  options.steps)
        if len(offsets_S1) < 2:
            raise UserError(f"{options.lengths}: {stream.num_samples} usable samples, too few "
                            "for one global batch")
    else:
        stream, offsets_S1 = drawn_stream(options.dist, options.seed, per_step,
                                          options.global_batch_tokens,
                                          options.steps or DEFAULT_STEPS)
        row_N = np.arange(stream.num_samples, dtype=np.int64)
    cfg = options.config
    k = largest_sp_size(cfg.sp_max, cfg.dp)
    planned_N = stream.tokens_N[: offsets_S1[-1]]
    too_long = np.flatnonzero(planned_N > cfg.micro_batch_tokens * k)
    if len(too_long):
        i = int(too_long[0])
        raise UserError(f"sample {row_N[i]}: {planned_N[i]} tokens, more than --micro-batch-tokens "
                        f"× largest SP group = {cfg.micro_batch_tokens} × {k}; raise "
                        "--micro-batch-tokens or --sp-max")
    return stream, offsets_S1, row_N


def simulate_command(args: argparse.Namespace, console: Console | None = None) -> dict:
    """Run every policy, print the comparison, write the plot and plan if asked; return it."""
    options = options_from_args(args)
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    # the cost file first: a bad one is refused in one line before the samples are read
    if options.costs_file is not None:
        costs = costs_of(read_cost_file(options.costs_file)["costs"])
    else:
        costs = default_costs(options.alpha, options.beta, options.comm)
    stream, offsets_S1, row_N = samples_for(options)
    runs = [run_policy(name, stream, offsets_S1, costs, options.config)
            for name in judged(ALL_POLICIES)]
    result = compare(runs, stream, offsets_S1, costs, options.config)
    runs = [r for r in runs if r.name != OURS_STEP_SYNC]  # its DDP figures are in ours' row
    result["input"] = str(options.lengths) if options.lengths else f"dist:{options.dist}"
    if options.costs_file is not None:
        result["cost"] = {"file": str(options.costs_file), "unit": "seconds",
                          "linear": costs.llm.alpha, "quadratic": costs.llm.beta,
                          "per_sequence": costs.llm.gamma, "micro_batch": costs.micro_batch}
        result["comm"] = {"from": str(options.costs_file),
                          "sp_comm_per_token": costs.sp_comm_per_token,
                          "reshard_per_token": costs.reshard_per_token}
    else:
        result["cost"] = {"linear": options.alpha, "quadratic": options.beta}
        result["comm"] = comm_json(options.comm)
    if options.plot is not None:
        write_plot(options.plot, runs, result["ideal_time"] / max(result["steps"], 1))
        result["plot"] = str(options.plot)
    if options.plan_out is not None:
        write_plan(options.plan_out, next(r for r in runs if r.name == OURS), row_N)
        result["plan_out"] = str(options.plan_out)
    if options.json:
        print(json.dumps(result, indent=1))
    else:
        print_result(result, console)
    return result


def print_result(result: dict, console: Console) -> None:
    """Which policies ran, the table, and our speed-up over the best baseline that may split
    (and, labelled, over the best no-split one)."""
    comm = result.get("comm")
    if comm is None:
        priced = ""
    elif "from" in comm:
        priced = f", costs and comm in seconds from {comm['from']}"
    else:
        priced = f", comm {bandwidth_label(comm['bandwidth_bytes_per_s'] or math.inf)} per rank"
    speeds = result.get("rank_speed")
    ranks = f"{result['dp']} ranks" + (
        f" of speeds {','.join(f'{v:g}' for v in speeds)}" if speeds else "")
    console.print(f"policies: {', '.join(result['policies'])}  ({result['input']}: "
                  f"{result['samples']:,} samples, {result['items']:,} encoder items, "
                  f"{result['steps']} steps on {ranks}, window {result['window']}, "
                  f"sp_max {result['sp_max']}, budget {result['micro_batch_tokens']:,} tokens"
                  f"{priced})")
    pooled = "the ranks' summed speeds" if speeds else "ranks"
    table = Table(title=f"balance simulate: per policy (time / ideal: ideal = all compute / "
                        f"{pooled}; comm = SP + reshard all-to-all per rank / ideal)")
    for col in ("policy", "imb mean", "imb p95", "max/LB", "DDP/ideal", "FSDP/ideal", "comm",
                "disp mean", "disp max", "ms/step", "violations", "exactly once"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    ideal = result["ideal_time"] or 1.0
    for name, p in result["policies"].items():
        label = name if p.get("may_split", True) else f"{name} (no split)"
        table.add_row(label, f"{p['imbalance_mean']:.3f}", f"{p['imbalance_p95']:.3f}",
                      f"{p['max_over_lb_mean']:.3f}", f"{p['ddp_over_ideal']:.3f}",
                      f"{p['fsdp_over_ideal']:.3f}",
                      f"{(p.get('sp_comm_per_rank', 0) + p.get('reshard_comm', 0)) / ideal:.3f}",
                      f"{p['displacement_mean']:.2f}",
                      str(p["displacement_max"]), f"{p['planner_ms_per_step']:.2f}",
                      str(p["violations"]), "yes" if p["exactly_once"] else "NO")
    console.print(table)
    if result["policies"].get(OURS, {}).get("ddp_planned_with_sync") == "step":
        console.print(f"{OURS}: DDP as planned for ranks that meet once a step, the rest as "
                      "planned for ranks that meet every micro-batch (the trainer's)")
    for key, best_key, which in (
            ("speedup_vs_best_baseline", "best_baseline", "the best baseline"),
            ("speedup_vs_best_no_split_baseline", "best_baseline_no_split",
             "the best no-split baseline")):
        for objective, speedup in result.get(key, {}).items():
            best = result[best_key][objective]
            console.print(f"{OURS} {objective.upper()} step time: {speedup:.2f}x faster than "
                          f"{which} ({best})")
    for key in ("plot", "plan_out"):
        if key in result:
            console.print(f"wrote {result[key]}")


def write_plot(path: Path, runs: list[PolicyRun], ideal_step: float) -> None:
    """One heatmap per policy: each rank's load per step over the ideal step load."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry

    loads = [rank_loads(run) / (ideal_step if ideal_step > 0 else 1.0) for run in runs]
    top = max([float(load.max()) for load in loads if load.size] + [1.0])
    fig = Figure(figsize=(3.2 * len(runs) + 1.2, 4.2), layout="constrained")
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    image = None
    for ax, run, load_SR in zip(axes, runs, loads):
        image = ax.imshow(load_SR.T, aspect="auto", origin="lower", cmap="viridis",
                          vmin=0.0, vmax=top, interpolation="nearest")
        ax.set_title(run.name, fontsize="medium")
        ax.set_xlabel("step")
    axes[0].set_ylabel("rank")
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="rank load / ideal step load")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def write_plan(path: Path, run: PolicyRun, row_N: np.ndarray) -> None:
    """One row per placement: sample (file row), step, rank, micro_batch, sp_group_size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    plans = run.plans
    table = pa.table({
        "sample": np.concatenate([row_N[p.sample_P] for p in plans]).astype(np.int64),
        "step": np.concatenate([np.full(len(p.sample_P), p.step, np.int64) for p in plans]),
        "rank": np.concatenate([p.rank_P for p in plans]).astype(np.int32),
        "micro_batch": np.concatenate([p.micro_batch_P for p in plans]).astype(np.int32),
        "sp_group_size": np.concatenate([p.sp_size_P for p in plans]).astype(np.int32),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)

