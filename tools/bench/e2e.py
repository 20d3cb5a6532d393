"""End-to-end balancing benchmark: the same training run, its steps planned by each policy.

    .venv/bin/python tools/bench/e2e.py [--workload even|uneven|long_tail] [--warmup 4]
        [--rounds 3]
        [--schedule interleaved|separate] [--cycles 2] [--nproc 2] [--scale small]
        [--out docs/bench/e2e.json]

Workloads: ``even`` (the default; below), ``uneven`` (``tools/bench/e2e_uneven.py``: the same
runs with rank 1 slowed mid-run by a process pinned to its CPU; 30 steps, the neighbour from
step 8 to 22, figures over steps 14-21; ``docs/bench/e2e_uneven.json``) and ``long_tail``
(``tools/bench/e2e_long_tail.py``, run with the other arguments, which are its own: long
documents split over the SP group, against the static layouts; ``docs/bench/e2e_long_tail.json``).
So this one script runs the README's three end-to-end workloads.

Each run is ``omniscale train configs/demo_omni.yaml --nproc 2`` with ``data.balance`` set to
the policy and everything else equal: model (the tiny omni preset), seed, steps, data (the
demo at ``--scale``, every source from step 0: text with image, video and audio, long-tailed),
``parallel.sp 2`` so that a sample longer than a micro-batch is split over the two ranks (every
baseline gets the planner's split decision: the same splitting), FSDP over both processes.
The even workload's schedule is interleaved (``tools/bench/e2e_interleave.py``): each run
plans its windows by the policies in turn, and a round is one run per rotation of the turns,
so every policy trains the same windows at times interleaved with the others' -- this
machine's speed drifts by up to 1.7x over tens of seconds, which whole runs a minute apart
cannot tell from a policy's effect; ``--cycles`` turns of each policy per run (default 2:
each round then pairs the policies over 2 x policies windows). ``--schedule separate`` (the
uneven workload's default: its neighbour starts at a step) runs each policy once a round, in a
different order each round (rotated); the uneven workload with ``--schedule interleaved`` keeps
its 30 steps and neighbour and plans the windows by the policies in turn
(``e2e_uneven.turns_round``: each policy's figures over its slowed turns, the same steps for
every policy over a round). Each run is in a fresh run directory; the first
``--warmup`` steps of each run are left out. Every policy plans with the same cost model: by
default ``omniscale balance calibrate`` times this run's model here first (``--costs
calibrate``; its fit goes into the JSON), as a user would; ``--costs FILE`` takes a cost file,
``--costs flops`` the model's FLOP counts.

Per policy and round: tokens/s (the measured steps' tokens over their summed step time),
median step time, the mean measured (compute clock, waiting excluded) and predicted
imbalance, and where the steps' time went (each phase's mean seconds: ``phase_wall_s_mean``,
``phase_compute_s_mean``; the trainer's ``rank_phase_*_s``). The headline is the median over
rounds of ours / the best baseline, paired by round, with its minimum and maximum: the best
baseline is the one policy with the highest median tokens/s over the rounds
(``tools/bench/paired.py`` says why not each round's fastest; that figure is kept beside it,
``ratio_vs_each_rounds_fastest_baseline``).

Each run records what other processes took of the CPUs while it ran (``foreign_cpu_share``,
``tools/bench/contention.py``); ``--wait-quiet-s S`` waits up to S seconds before each run
until they take under ``--max-foreign`` (no wait by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from omniscale.tools.bench import e2e_interleave, e2e_uneven  # noqa: E402
from omniscale.tools.bench.contention import Contention, wait_quiet  # noqa: E402
from omniscale.tools.bench.paired import paired_ratios, spread  # noqa: E402
from omniscale.tools.bench.provenance import provenance  # noqa: E402

POLICIES = ("omniscale", "token_lpt", "kk_cost", "first_fit", "strided")
OURS = "omniscale"


def prepare(data: Path, scale: str) -> Path:
    from omniscale.loaders.index import index_paths
    from omniscale.tools.demo import generate
    from omniscale.tools.demo.specs import every_source_spec

    demo = data / f"demo-{scale}"
    if not (demo / "mix.yaml").is_file():
        print(f"generating the {scale} demo under {demo} ...", flush=True)
        generate(demo, scale=scale, seed=3, progress=False)
    index_paths([demo / "mix.yaml"], progress=False)
    return every_source_spec(demo, data / f"every-{scale}.yaml")


def run(policy: str, spec: Path, out: Path, args, sets: dict | None = None,
        env: dict | None = None, during=None) -> dict:
    """One training run with ``data.balance`` = ``policy``; ``sets``: more ``--set``
    overrides, ``env``: its environment, ``during``: a context manager factory given the
    run's metrics file, entered while it runs (the uneven workload's neighbour)."""
    rows = train(policy, spec, out, args, sets, env, during)
    return {**measured_stats(rows[args.warmup:]), "loss_last": rows[-1]["loss"]}


def train(policy: str, spec: Path, out: Path, args, sets: dict | None = None,
          env: dict | None = None, during=None) -> list[dict]:
    """``omniscale train`` as :func:`run` describes it; its metrics rows."""
    sets = {"data.spec": spec, "data.balance": policy, "steps": args.steps,
            "checkpoint_every": args.steps, "output_dir": out, "eval.enabled": "false",
            "parallel.sp": 2, "parallel.dp_shard": 1, "data.workers": args.workers,
            "data.global_batch_tokens": args.global_batch_tokens,
            "data.micro_batch_tokens": args.micro_batch_tokens, "data.window": args.window,
            "optim.warmup_steps": 2, "deterministic": "true", **(sets or {})}
    if args.costs != "flops":
        sets["data.costs"] = args.costs
    cmd = [sys.executable, "-m", "omniscale", "train", "configs/demo_omni.yaml", "--nproc",
           str(args.nproc), "--no-progress"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    with contextlib.ExitStack() as stack:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        if during is not None:
            stack.enter_context(during(out / "metrics.jsonl"))
        _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{policy}: omniscale train failed:\n{stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def measured_stats(measured: list[dict]) -> dict:
    """A policy's figures over its measured steps' metrics rows."""
    seconds = sum(r["step_s"] for r in measured)
    return {"tokens_per_s": sum(r["tokens"] for r in measured) / seconds,
            "step_s_median": statistics.median(r["step_s"] for r in measured),
            "imbalance_measured": statistics.mean(r["imbalance_measured"] for r in measured),
            "imbalance_predicted": statistics.mean(r["imbalance_predicted"] for r in measured),
            "tokens": sum(r["tokens"] for r in measured), "steps": len(measured),
            "micro_batches_mean": statistics.mean(r["micro_batches"] for r in measured),
            "sp_split_samples": sum(r.get("sp_split_samples", 0) for r in measured),
            "media_items_moved_mean": statistics.mean(r.get("media_items_moved", 0)
                                                      for r in measured),
            "compute_s_mean": statistics.mean(statistics.mean(r["rank_compute_s"])
                                              for r in measured),
            **phase_means(measured)}


def phase_means(measured: list[dict]) -> dict:
    """Per phase of the step (the trainer's ``rank_phase_*_s``, CPU runs): the mean over
    steps of the slowest rank's wall seconds (the phases end in collectives, so the ranks'
    walls nearly agree) and of the ranks' mean compute seconds; {} when not recorded."""
    if not measured or not all("rank_phase_wall_s" in r for r in measured):
        return {}
    names = list(measured[0]["rank_phase_wall_s"])
    return {"phase_wall_s_mean": {n: statistics.mean(max(r["rank_phase_wall_s"][n])
                                                     for r in measured) for n in names},
            "phase_compute_s_mean": {n: statistics.mean(statistics.mean(
                r["rank_phase_compute_s"][n]) for r in measured) for n in names}}


def interleaved_round(r: int, policies: list[str], spec: Path, tmp: Path, args) -> dict:
    """Round ``r`` of the interleaved schedule (``e2e_interleave``): one run per rotation of
    the turn order; each policy's figures over all its turns in them (the same samples for
    every policy), each run's apart in ``runs_each``."""
    rows: dict[str, list[dict]] = {p: [] for p in policies}
    orders, each = [], []
    rotations = e2e_interleave.runs_a_round(args, policies)
    for j in range(rotations):
        got, record = e2e_interleave.run_rotation(r, j, policies, train, OURS, spec,
                                                  tmp / f"r{r}-turns{j}", args)
        order, share = record["order"], record["foreign_cpu_share"]
        mine = e2e_interleave.rows_by_policy(got, args.warmup, policies)
        for p in policies:
            rows[p] += mine[p]
        orders.append(order)
        each.append({**record,
                     "tokens_per_s": {p: measured_stats(mine[p])["tokens_per_s"]
                                      for p in policies}})
        print(f"round {r + 1}/{args.rounds} run {j + 1}/{rotations} (turns "
              f"{', '.join(order)}): " + "  ".join(
                  f"{p} {v:.0f}" for p, v in each[-1]["tokens_per_s"].items())
              + f" tok/s  other processes {share:.0%} of the CPUs", flush=True)
    runs = {p: {**measured_stats(rows[p]), "loss_last": rows[p][-1]["loss"]} for p in policies}
    if rotations == len(policies):  # fewer (a quick check): each policy its own windows
        e2e_interleave.check_same_data(runs)
    return {"order": orders, "runs": runs, "runs_each": each}


def calibrate(spec: Path, args) -> dict:
    """``omniscale balance calibrate`` of the benchmark's run (its model, spec and micro-batch
    budget, each rank's threads) into ``args.costs``; the fit's summary."""
    cmd = [sys.executable, "-m", "omniscale", "balance", "calibrate", "configs/demo_omni.yaml",
           "--set", f"data.spec={spec}", "--set", "eval.enabled=false",
           "--set", f"data.micro_batch_tokens={args.micro_batch_tokens}",
           "--nproc", str(args.nproc), "--out", args.costs]
    print("calibrating the cost model:", " ".join(cmd[2:]), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"omniscale balance calibrate failed:\n{done.stderr[-2000:]}")
    doc = json.loads(Path(args.costs).read_text())
    print("\n".join(done.stdout.strip().splitlines()[-5:]), flush=True)
    return {"llm": {k: doc["llm"].get(k) for k in ("alpha", "beta", "gamma", "per_micro_batch",
                                                   "per_micro_batch_one_process", "per_step", "r2",
                                                   "mape", "held_out")},
            "encoders": {k: {f: v[f] for f in ("alpha", "beta", "gamma", "r2", "mape")}
                         for k, v in doc["encoders"].items()},
            "collectives": doc.get("collectives"), "layout": doc.get("layout"),
            "elapsed_s": doc.get("elapsed_s"), "threads": doc.get("threads")}


def _median(values: list) -> float | None:
    """The median of the rounds that have the figure (a baseline plans by no speeds)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize(path: Path, out: Path, argv: list[str] | None) -> dict:
    """``--summarize``: the headline of the JSON at ``path`` recomputed by
    :func:`ratios_vs_best` from its rounds, with what did it (``summarized``: this command and
    commit; the measurement's own ``git_commit`` stays)."""
    doc = json.loads(path.read_text())
    for r in doc["rounds"]:  # each round's fastest baseline, as an earlier version kept it
        r.pop("best_baseline", None)
        r.pop("ratio_vs_best_baseline", None)
    doc.update(ratios_vs_best(doc["rounds"], list(doc["median"])))
    done = provenance()
    doc["summarized"] = {"command": " ".join(["tools/bench/e2e.py"] + (argv or sys.argv[1:])),
                         "git_commit": done["git_commit"], "git_dirty": done["git_dirty"]}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    spread = doc["ratio_vs_best_baseline"]
    print(f"{out}: ours / best baseline ({doc['best_baseline']}) {spread['median']:.3f}x "
          f"({spread['min']:.3f}-{spread['max']:.3f}); against each round's fastest "
          f"{doc['ratio_vs_each_rounds_fastest_baseline']['median']:.3f}x")
    return doc


def ratios_vs_best(rounds: list[dict], policies: list[str]) -> dict:
    """The headline (``tools.bench.paired``): ours over the baseline with the highest median
    tokens/s, paired by round (``ratio_vs_best_baseline``: median, min, max; the baseline in
    ``best_baseline``), and, the conservative figure, ours over each round's fastest baseline
    (``ratio_vs_each_rounds_fastest_baseline``, ``fastest_baseline_each_round``)."""
    rates = [{p: v["tokens_per_s"] for p, v in r["runs"].items()} for r in rounds]
    got = paired_ratios(rates, OURS, [p for p in policies if p != OURS])
    if not got:
        return {"best_baseline": None, "ratio_vs_best_baseline": None,
                "ratio_vs_each_rounds_fastest_baseline": None}
    return {"best_baseline": got["best"], "ratio_vs_best_baseline": spread(got["ratios"]),
            "fastest_baseline_each_round": got["fastest_each_round"],
            "ratio_vs_each_rounds_fastest_baseline": spread(
                got["ratios_vs_fastest_each_round"])}


WORKLOADS = ("even", "uneven", "long_tail")


def _workload(argv: list[str] | None) -> tuple[str, list[str]]:
    """``--workload`` and the arguments without it (for the long-tail script, whose flags
    differ)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload", choices=WORKLOADS, default="even")
    known, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    return known.workload, rest


def main(argv: list[str] | None = None) -> dict:
    workload, rest = _workload(argv)
    if workload == "long_tail":  # its own script and flags
        from omniscale.tools.bench import e2e_long_tail

        return e2e_long_tail.main(rest)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "omniscale-bench")
    ap.add_argument("--scale", default="small", choices=("tiny", "small", "medium"))
    ap.add_argument("--schedule", choices=("interleaved", "separate"), default=None,
                    help="interleaved (the even workload's default): each run plans its "
                         "windows by the policies in turn, one run per rotation of the turns "
                         "a round (tools/bench/e2e_interleave.py; uneven: "
                         "e2e_uneven.turns_round, its --steps kept); separate (uneven's "
                         "default): one run per policy a round")
    ap.add_argument("--steps", type=int, default=None,
                    help="separate runs' steps (default 12, uneven 30); interleaved runs "
                         "take --warmup + --window x policies x --cycles")
    ap.add_argument("--warmup", type=int, default=4,
                    help="steps left out (a whole window: the planner moves samples within it)")
    ap.add_argument("--window", type=int, default=4,
                    help="global batches the plane plans together (data.window)")
    ap.add_argument("--cycles", type=int, default=2,
                    help="interleaved: each policy's turns (of one window) per run (a round's "
                         "ratio pairs policies over policies x cycles windows)")
    e2e_interleave.add_rotations_argument(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="decode processes per rank")
    ap.add_argument("--global-batch-tokens", type=int, default=16384)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--costs", default="calibrate",
                    help="the cost model of every run: calibrate (time the model here first, "
                         "the default), a cost file of `omniscale balance calibrate`, or flops")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--no-reshard", action="store_true",
                    help="diagnostic: price moving an encoder output at 1 s per token in the "
                         "cost file, so every item is encoded where it is consumed")
    ap.add_argument("--workload", choices=WORKLOADS, default="even",
                    help="long_tail: tools/bench/e2e_long_tail.py with the other arguments "
                         "(its flags: --workload long_tail --help)")
    ap.add_argument("--slow-from", type=int, default=8,
                    help="uneven: the step the neighbour starts at")
    ap.add_argument("--slow-until", type=int, default=22,
                    help="uneven: the step it stops at (past --steps: never)")
    ap.add_argument("--settle", type=int, default=6,
                    help="uneven: steps after --slow-from left out of the figures")
    ap.add_argument("--max-foreign", type=float, default=0.1,
                    help="wait (up to --wait-quiet-s) before each run until other processes "
                         "take under this share of the CPUs; each run records the share they "
                         "took while it ran (foreign_cpu_share)")
    ap.add_argument("--wait-quiet-s", type=float, default=0.0,
                    help="how long to wait for a quiet machine before each run (0: no wait)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--summarize", type=Path, metavar="JSON",
                    help="measure nothing: recompute the headline of a JSON this script wrote "
                         "from its rounds (the runs' own figures stay as measured) and write it "
                         "back (to --out if given)")
    args = ap.parse_args(argv)
    if args.summarize is not None:
        return summarize(args.summarize, args.out or args.summarize, argv)
    uneven = args.workload == "uneven"
    policies = args.policies.split(",")
    interleaved = (args.schedule or ("separate" if uneven else "interleaved")) == "interleaved"
    if interleaved:
        if len(policies) < 2 or (args.steps is not None and not uneven):
            ap.error("--schedule interleaved: two or more policies; the even workload's runs' "
                     "steps follow from --warmup, --window, --cycles and the policies")
        e2e_interleave.check_rotations(ap, args.rotations, len(policies))
        if not uneven:
            args.steps = e2e_interleave.steps_per_run(args.warmup, args.window, len(policies),
                                                      args.cycles)
    elif args.rotations is not None:
        ap.error("--rotations: runs of the turns (--schedule interleaved); the separate "
                 "schedule runs each policy once a round")
    if args.steps is None:
        args.steps = 30 if uneven else 12
    slow_until = args.slow_until if args.slow_until < args.steps else None
    started = provenance()
    spec = prepare(args.data, args.scale)
    calibration = None
    if args.costs == "calibrate":
        args.costs = str(args.data / f"costs-{args.scale}-{args.micro_batch_tokens}.json")
        calibration = calibrate(spec, args)
    if args.no_reshard:
        if args.costs == "flops":
            raise SystemExit("--no-reshard needs a cost file (--costs calibrate or FILE)")
        doc = json.loads(Path(args.costs).read_text())
        doc["collectives"] = {**doc.get("collectives", {}), "reshard_per_token": 1.0}
        args.costs = str(args.data / "costs-no-reshard.json")
        Path(args.costs).write_text(json.dumps(doc, indent=2) + "\n")
    # uneven: the trainer's settings and environment, and the neighbour started during the run
    uneven_run = {"sets": e2e_uneven.SETS, "env": e2e_uneven.environment(),
                  "during": lambda m: e2e_uneven.Neighbour(m, args.slow_from, slow_until)
                  } if uneven else {}
    rounds = []
    with tempfile.TemporaryDirectory(prefix="omniscale-e2e-") as tmp:
        for r in range(args.rounds):
            if interleaved and uneven:
                rounds.append(e2e_uneven.turns_round(r, policies, spec, Path(tmp), args,
                                                     slow_until, train, OURS))
                continue
            if interleaved:
                rounds.append(interleaved_round(r, policies, spec, Path(tmp), args))
                continue
            order = e2e_interleave.rotation(policies, r)  # a different policy first each round
            runs = {}
            for policy in order:
                out = Path(tmp) / f"r{r}-{policy}"
                quiet = wait_quiet(args.max_foreign, args.wait_quiet_s)
                with Contention() as contention:
                    runs[policy] = run(policy, spec, out, args, **uneven_run)
                if uneven:
                    rows = [json.loads(line) for line in
                            (out / "metrics.jsonl").read_text().splitlines()]
                    runs[policy].update(e2e_uneven.analyse(rows, args.slow_from, slow_until,
                                                           args.settle, args.warmup,
                                                           plans_by_speed=policy == OURS))
                runs[policy].update(foreign_cpu_share=round(contention.share, 3), **quiet)
                got = runs[policy]
                print(f"round {r + 1}/{args.rounds} {policy:10s} "
                      f"{got['tokens_per_s']:8.0f} tok/s  step {got['step_s_median']:.3f} s  "
                      f"imbalance measured {got['imbalance_measured']:.3f} predicted "
                      f"{got['imbalance_predicted']:.3f}" + (
                          f"  ideal {got['ideal_fraction']:.3f}  recovered in "
                          f"{got['recovery_steps']} steps" if uneven else "")
                      + f"  other processes {contention.share:.0%} of the CPUs", flush=True)
            rounds.append({"order": order, "runs": runs})
    keys = ("tokens_per_s", "step_s_median", "imbalance_measured", "imbalance_predicted") + (
        ("ideal_fraction", "step_s_before", "step_s_slowed", "rank1_speed_measured",
         "planned_for_slowdown_after_steps", "planned_for_release_after_steps")
        if uneven else ()) + (("speeds_applied_after_slowdown_steps",
                               "speeds_applied_after_release_steps")
                              if uneven and interleaved else ())
    summary = {p: {k: _median([r["runs"][p].get(k) for r in rounds]) for k in keys}
               for p in policies}
    result_ratios = ratios_vs_best(rounds, policies)
    result = {"command": " ".join(["tools/bench/e2e.py"] + (argv or sys.argv[1:])),
              **started, "scale": args.scale, "nproc": args.nproc, "steps": args.steps,
              "warmup": args.warmup, "global_batch_tokens": args.global_batch_tokens,
              "micro_batch_tokens": args.micro_batch_tokens, "sp": 2,
              "costs": args.costs, "calibration": calibration,
              "no_reshard": args.no_reshard, "workload": args.workload,
              "schedule": "interleaved" if interleaved else "separate", "window": args.window,
              **({"cycles": args.cycles} if interleaved and not uneven else {}),
              **({"rotations": e2e_interleave.runs_a_round(args, policies)}
                 if interleaved else {}),
              **({"neighbour": e2e_uneven.describe(args.slow_from, slow_until),
                  "settle": args.settle, "figures_over_steps": [
                      args.slow_from + args.settle, (slow_until or args.steps) - 1],
                  "planned_by_speed": [OURS], "settings": e2e_uneven.SETS} if uneven else {}),
              "rounds": rounds,
              "median": summary, **result_ratios}
    for p in policies:
        s = summary[p]
        print(f"{p:10s} {s['tokens_per_s']:8.0f} tok/s  step {s['step_s_median']:.3f} s  "
              f"imbalance measured {s['imbalance_measured']:.3f} predicted "
              f"{s['imbalance_predicted']:.3f}")
    if result["ratio_vs_best_baseline"]:
        spread, each = result["ratio_vs_best_baseline"], \
            result["ratio_vs_each_rounds_fastest_baseline"]
        print(f"ours / best baseline ({result['best_baseline']}, the highest median tokens/s; "
              f"median of {len(rounds)} paired rounds"
              f"{', interleaved' if interleaved else ''}): {spread['median']:.3f}x "
              f"({spread['min']:.3f}-{spread['max']:.3f}); against each round's fastest "
              f"baseline {each['median']:.3f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
