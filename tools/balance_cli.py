"""``omniscale balance …``: the planner against baselines in simulation, and the cost model
calibrated on this machine. Each subcommand: its arguments (``_add_*``) and its handler."""

from __future__ import annotations

import argparse
import sys


def add_commands(commands) -> None:
    balance = commands.add_parser("balance", help="compute-aware placement of samples on ranks")
    subcommands = balance.add_subparsers(dest="balance_command", required=True,
                                         metavar="SUBCOMMAND")
    _add_simulate(subcommands)
    _add_calibrate(subcommands)


def _add_simulate(subcommands) -> None:
    """``balance simulate``: the samples, the layout, communication, the batch."""
    sim = subcommands.add_parser(
        "simulate", help="our planner against baselines on the same global batches")
    source = sim.add_argument_group("samples (exactly one)")
    source.add_argument("--lengths", metavar="FILE",
                        help="Parquet or JSONL with llm_tokens (and encoder_patches), or a "
                             "source index (_index.parquet)")
    source.add_argument("--dist", metavar="NAME",
                        help="built-in generator: lognormal, omni, uniform, bimodal")
    sim.add_argument("--dp", type=int, default=8, help="data-parallel ranks (default 8)")
    sim.add_argument("--rank-speeds", metavar="SPEEDS", default=None,
                     help="each rank's relative speed, comma-separated, one per rank "
                          "(1,1,0.5,0.5: mixed GPU generations): ours plans by them, the "
                          "baselines place blind to them, and every plan is judged in time "
                          "(default: equal ranks)")
    sim.add_argument("--window", type=int, default=4,
                     help="global batches planned together (default 4)")
    sim.add_argument("--micro-batch-tokens", type=int, default=16384,
                     help="hard per-rank micro-batch token budget (default 16384)")
    sim.add_argument("--costs", metavar="COSTS.json", default=None,
                     help="a cost file of `omniscale balance calibrate` (seconds): every model, "
                          "the micro-batch's fixed cost and the collectives' prices as a run's "
                          "plane plans with them; replaces --cost-linear, --cost-quadratic and "
                          "the communication flags")
    sim.add_argument("--cost-linear", type=float, default=24576.0,
                     help="alpha in alpha*L + beta*L^2 (default 24576)")
    sim.add_argument("--cost-quadratic", type=float, default=1.0,
                     help="beta in alpha*L + beta*L^2 (default 1)")
    sim.add_argument("--sp-max", type=int, default=8,
                     help="largest sequence-parallel group, a power of two (default 8)")
    sim.add_argument("--steps", type=int, default=None,
                     help="global batches to plan (default: 16 with --dist, all with --lengths)")
    comm = sim.add_argument_group(
        "communication (SP all-to-all, encoder reshard), charged to every policy")
    comm.add_argument("--bandwidth", type=float, default=25.0, metavar="GB/s",
                      help="all-to-all bandwidth per rank in GB/s (default 25; inf: free)")
    comm.add_argument("--hidden-size", type=int, default=4096,
                      help="model hidden size: bytes per token (default 4096)")
    comm.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    comm.add_argument("--dtype-bytes", type=int, default=2,
                      help="bytes per activation value (default 2, bf16)")
    comm.add_argument("--unit-seconds", type=float, default=6 * 32 * 4096 / 400e12,
                      help="seconds one cost unit takes (default 1.966e-9: 6*32*4096 FLOPs, "
                           "the default cost's L^2 term for this shape, at 400 TFLOP/s)")
    batch = sim.add_argument_group("global batch (at most one; default 8 samples per rank)")
    batch.add_argument("--samples-per-rank", type=int, default=None)
    batch.add_argument("--global-batch-tokens", type=int, default=None,
                       help="greedy global batches of at most this many tokens")
    sim.add_argument("--epsilon", type=float, default=0.05,
                     help="per-step token and mixture tolerance (default 0.05)")
    sim.add_argument("--seed", type=int, default=0, help="generator seed for --dist")
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.add_argument("--plot", metavar="FILE.png", help="draw per-rank load per step per policy")
    sim.add_argument("--plan-out", metavar="FILE.parquet",
                     help="write our plan: one row per placement")
    sim.set_defaults(func=_balance_simulate)


def _add_calibrate(subcommands) -> None:
    """``balance calibrate CONFIG``"""
    cal = subcommands.add_parser(
        "calibrate", help="time the run's model here and fit the balancer's cost model")
    cal.add_argument("config", metavar="CONFIG.yaml", help="the run config (model and data)")
    cal.add_argument("--out", default="costs.json", help="cost file to write (costs.json)")
    cal.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override a config field, as for train")
    cal.add_argument("--repeats", type=int, default=3,
                     help="timed runs per measurement, the median kept (default 3)")
    cal.add_argument("--held-out", type=int, default=12,
                     help="random mixes timed apart from the fit, to score it (default 12)")
    cal.add_argument("--nproc", type=int, default=1,
                     help="ranks the run puts on this machine: on CPU each measurement gets "
                          "the threads one of them gets (default 1)")
    cal.set_defaults(func=_balance_calibrate)


def _balance_simulate(args: argparse.Namespace) -> int:
    from omniscale.tools.balance_sim import simulate_command

    simulate_command(args)
    return 0


def _balance_calibrate(args: argparse.Namespace) -> int:
    from omniscale.tools.balance_calibrate import calibrate, summary
    from omniscale.tools.bench.provenance import provenance
    from omniscale.tools.train.cost_model import write_cost_file

    started = provenance()  # commit and load: whoever reads the figures can weigh them
    result = calibrate(args.config, args.set or [], repeats=args.repeats,
                       held_out=args.held_out, progress=lambda line: print(line, flush=True),
                       nproc=args.nproc)
    result = {"command": " ".join(["omniscale", *sys.argv[1:]]), **started, **result}
    write_cost_file(args.out, result)
    print(summary(result))
    print(f"wrote {args.out} (data.costs / plane serve --costs)")
    return 0
