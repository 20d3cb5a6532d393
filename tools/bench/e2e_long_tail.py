"""End-to-end long-tailed workload (issue #44, item 3): where splitting long samples pays.

    .venv/bin/python tools/bench/e2e_long_tail.py [--schedule interleaved|separate] [--warmup 4]
        [--rounds 2] [--scale small] [--costs calibrate|FILE|flops]
        [--out docs/bench/e2e_long_tail.json]

The same 2-process CPU training run as ``tools/bench/e2e.py`` (``omniscale train
configs/demo_omni.yaml --nproc 2``, the placement policies in turns, its ``run``, ``calibrate``
and ``prepare`` reused), on long-tailed data:

- data (:func:`prepare`): the demo's sources (``tools/demo``, seed 3, every source from step 0)
  plus ``long_docs`` (``tools/demo/long_docs.py``): real text cut to bounded-Pareto lengths
  from ``MIN_TOKENS`` to what one SP group holds, SP × ``data.micro_batch_tokens`` (2 × 4,096:
  with two ranks no sample can be longer -- the plane truncates longer text to that). The
  mix counts samples (``WEIGHTS``): mostly long documents, a few of each demo source, so a
  step of 16,384 tokens holds about 4 samples per rank and attention (β·L², α/β ≈ 4,000
  tokens on this machine) is a large share of a step;
- settings (``SETS``): ``parallel.sp 2`` on 2 ranks, micro-batches of 4,096 tokens, global
  batches of 16,384;
- policies (``POLICIES``): ours; the static layout users of other systems run, ``static_sp``
  (``balancer/baselines.py``: every sequence sharded over the SP group, as torchtitan's
  context parallelism and VeOmni's Ulysses SP do, its media balanced by our encoder plan);
  and the per-step baselines, each given our long-short split.

The static layout without SP ("none") is not run: it cannot train this data. Every
long document is longer than one micro-batch, so without SP the plane truncates it to the
budget (text) or skips it (media). That run would train different, shorter data, and its
tokens/s would be no comparison. The JSON says how many samples and tokens that would drop
(``no_sp``).

Beside every measured ratio is the prediction for the same data (:func:`predict`): the
plane's own windows (the trainer's spec, mixer and sample cap) planned by each policy through
``dataplane.windows.plan_policy``, each plan re-priced from its placements
(``balancer.simulate.reprice``: c/k plus the SP all-to-all, encoders where they run, the
reshard) with the run's cost model, and timed as an FSDP step: per micro-batch slot the
slowest rank, plus the slowest rank's encoders, the reshard and each slot's fixed cost.
A cost file of ``omniscale balance calibrate`` prices no collective unless it has a
``collectives`` entry. Then the prediction charges the SP all-to-all nothing, and what
static SP pays for sharding every sequence shows only in the measurement.

Tokens/s counts the samples' own tokens (``RATE``): every policy trains the same samples in
the measured windows, so the ratios are ratios of time for the same work (the trainer's own
count adds the padding of split samples, most of all static SP's). Each run is checked to
train exactly the tokens the prediction planned (``prediction_draws_the_runs_tokens``).

On a shared machine another user's processes slow some runs and not others. Each run is
therefore timed with what other processes took of the CPUs (``Contention``). Before a run
the bench waits until they are quiet, and a run they took more than ``--max-foreign`` of the
CPUs from is run again (``--retries``). Every attempt stays in the JSON. The machine's speed
also drifts by itself, by up to 1.7x over tens of seconds, which whole runs a minute apart
cannot tell from a policy's effect. So by default (``--schedule interleaved``) each run plans
its windows by the policies in turns, a round being one run per rotation of the turns
(``tools/bench/long_tail_turns.py``; the even workload's schedule), and the run's length
follows from ``--warmup``, ``--window``, the policies and ``--cycles``. ``--schedule separate``
runs one policy per run, ``--steps`` steps each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from omniscale.tools.bench import e2e_interleave  # noqa: E402
from omniscale.tools.bench.contention import Contention, wait_quiet  # noqa: E402
from omniscale.tools.bench.long_tail_model import (  # noqa: E402
    AT_RUN_SPEED,
    RATE,
    SPEED_FROM,
    _measured,
    model_agreement,
)
from omniscale.tools.bench.paired import paired_ratios  # noqa: E402
from omniscale.tools.bench.paired import spread as _spread  # noqa: E402

SP = 2
MICRO_BATCH_TOKENS = 4096
GLOBAL_BATCH_TOKENS = 16384
# the `--set` overrides of `omniscale train` that make this workload (besides data.spec and
# the policy); tools/bench/e2e.py's `run` sets the same ones from its arguments
SETS = {"data.micro_batch_tokens": MICRO_BATCH_TOKENS,
        "data.global_batch_tokens": GLOBAL_BATCH_TOKENS, "parallel.sp": SP,
        "parallel.dp_shard": 1}
OURS = "omniscale"
STATIC = ("static_sp",)  # the static layouts run (a no-SP layout cannot run: module docstring)
PER_STEP = ("token_lpt", "kk_cost", "first_fit", "strided")  # each given our split
POLICIES = (OURS, *STATIC, *PER_STEP)
TARGETS = {"vs_static": 1.2, "vs_best_per_step": 1.0}  # issue #44 item 3

# the mix, in samples (accounting: samples): long documents most of all, one of each demo
# source for every six of them
WEIGHTS = {"long_docs": 6, "text": 1, "docs": 1, "image_caption": 1, "video_caption": 1,
           "audio_caption": 1, "interleaved": 1}
MIN_TOKENS = 1024  # long_docs: bounded Pareto from here to MAX_TOKENS (alpha 0.5)
# what one SP group holds (the plane's sample cap), less the end-of-text token the text
# template adds: the longest documents fill the cap, none is truncated
MAX_TOKENS = SP * MICRO_BATCH_TOKENS - 1
LONG_DOCS = {"tiny": 64, "small": 320, "medium": 1600}  # documents per demo scale
SEED = 3  # the demo's (tools/bench/e2e.py)


def prepare(data_dir: Path, scale: str) -> Path:
    """The workload's mixing spec (``long-tail-SCALE.yaml`` under ``data_dir``), its data
    generated and indexed if missing: the demo (``tools/bench/e2e.py``'s ``prepare``) and the
    long documents (``tools/demo/long_docs.py``) with the demo's tokenizer. Deterministic."""
    from omniscale.loaders.index import index_paths
    from omniscale.tools.bench.e2e import prepare as prepare_demo
    from omniscale.tools.demo import long_docs

    data_dir = Path(data_dir)
    every = prepare_demo(data_dir, scale)
    spec = yaml.safe_load(every.read_text())
    docs = data_dir / f"long-docs-{scale}-{MAX_TOKENS}"
    long_docs.build(docs, Path(spec["tokenizer"]), LONG_DOCS[scale], seed=SEED,
                    min_tokens=MIN_TOKENS, max_tokens=MAX_TOKENS)
    spec["accounting"] = "samples"
    spec["sources"] = [dict(s, weight=WEIGHTS[s["name"]]) for s in spec["sources"]] + [
        {"name": long_docs.NAME, "path": str(docs), "format": "webdataset",
         "template": "text", "weight": WEIGHTS[long_docs.NAME]}]
    out = data_dir / f"long-tail-{scale}.yaml"
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    index_paths([out], progress=False)
    return out


def _plane_config(policy: str, costs_file: str, dp: int, window: int = 4):
    from omniscale.dataplane.plane_config import PlaneConfig
    from omniscale.tools.train.cost_model import read_cost_file

    return PlaneConfig(dp=dp, micro_batch_tokens=SETS["data.micro_batch_tokens"],
                       window=window, global_batch_tokens=SETS["data.global_batch_tokens"],
                       sp_max=SETS["parallel.sp"], balance=policy, **read_cost_file(costs_file))


def draw_windows(spec: Path, config, n_windows: int) -> list:
    """The windows' samples (``balancer.types.WindowSamples``) as the run's plane draws them:
    its spec, mixer, global batch and sample cap (longer text truncated)."""
    from omniscale.dataplane.catalog import Catalog
    from omniscale.dataplane.mixer import Mixer
    from omniscale.dataplane.spec import load_spec
    from omniscale.dataplane.windows import window_samples

    mix = load_spec(spec)
    mixer = Mixer.from_spec(mix, Catalog.from_spec(mix, max_tokens=config.sample_cap),
                            **config.batch)
    return [window_samples([mixer.next_batch_table(k * config.window + j)
                            for j in range(config.window)], mix.media)
            for k in range(n_windows)]


def step_seconds(plan, samples, costs, dp: int, per_step: float = 0.0) -> dict:
    """A plan's predicted FSDP step (seconds of the cost file): the plan re-priced from its
    placements (``simulate.reprice``), per slot its slowest rank, the slowest rank's encoders,
    the reshard all-to-all, every slot's fixed cost and the step's own (``per_step``: the
    clip and the AdamW update, ``llm.per_step`` of a cost file calibrated on the layout)."""
    from omniscale.balancer.metrics import step_times
    from omniscale.balancer.simulate import reprice

    priced, reshard, sp_comm = reprice(plan, samples, costs, dp)
    slots = priced.num_micro_batches
    return {"step_s": step_times(priced)[1] + reshard + costs.micro_batch * slots + per_step,
            "tokens": int(samples.tokens_N[plan.samples()].sum()),
            # as the trainer counts them: a split sample padded to a multiple of k
            "tokens_padded": int(plan.mb_tokens_RB.sum()), "micro_batches": slots,
            "sp_split_samples": int(len(np.unique(plan.sample_P[plan.sp_size_P > 1]))),
            "samples": int(len(plan.samples())),
            "samples_per_rank_max": int(np.bincount(plan.rank_P, minlength=dp).max()),
            "imbalance": float(priced.imbalance), "sp_comm_s": sp_comm / dp,
            "reshard_s": reshard}


def predict(spec: Path, costs_file: str | None, args) -> dict:
    """The prediction for the runs' measured steps (``args.warmup`` to ``args.steps``, whole
    windows): every policy's plans of the same windows (``dataplane.windows.plan_policy``)
    timed by ``step_seconds``; tokens/s per policy and ours over each. ``costs_file``: the
    runs' cost file (None: no prediction -- the runs' FLOP-based costs are in FLOPs, not
    seconds). Also what a layout without SP would have to drop (``no_sp``)."""
    from omniscale.dataplane.windows import plan_policy

    if costs_file is None:
        return {"skipped": "no cost file: the prediction needs costs in seconds"}
    policies = list(getattr(args, "policies_list", POLICIES))
    base = _plane_config(OURS, costs_file, args.nproc, args.window)
    W = base.window
    windows = draw_windows(spec, base, math.ceil(args.steps / W))
    costs = base.cost_model(base.cost_linear, base.cost_quadratic)
    per_step = float(json.loads(Path(costs_file).read_text())["llm"].get("per_step", 0.0))
    steps: dict[str, list[dict]] = {p: [] for p in policies}
    for samples in windows:
        for policy in policies:
            config = _plane_config(policy, costs_file, args.nproc, W).planner(args.nproc, W)
            steps[policy] += [step_seconds(p, samples, costs, args.nproc, per_step)
                              for p in plan_policy(samples, costs, config, policy)]
    measured = {p: rows[args.warmup:args.steps] for p, rows in steps.items()}
    speed_steps = {p: rows[SPEED_FROM:args.warmup] for p, rows in steps.items()}
    result = {"steps": [args.warmup, args.steps], "window": W, "per_step_s": per_step,
              "speed_steps": [SPEED_FROM, args.warmup],
              "cost_file_collectives_priced": bool(costs.sp_comm_per_token
                                                   or costs.reshard_per_token),
              "policies": {}}
    for p, rows in measured.items():
        seconds = sum(r["step_s"] for r in rows)
        result["policies"][p] = {
            "tokens_per_s": sum(r["tokens"] for r in rows) / seconds,
            "step_s_mean": seconds / len(rows),
            "micro_batches_mean": statistics.mean(r["micro_batches"] for r in rows),
            "sp_split_samples": sum(r["sp_split_samples"] for r in rows),
            "imbalance_mean": statistics.mean(r["imbalance"] for r in rows),
            "sp_comm_s_per_rank": sum(r["sp_comm_s"] for r in rows),
            "tokens_per_step": [r["tokens"] for r in rows],
            "tokens_padded_per_step": [r["tokens_padded"] for r in rows],
            "step_s": [r["step_s"] for r in rows],
            # the warm-up steps the run's own speed is measured on (``_measured``)
            "speed_step_s": [r["step_s"] for r in speed_steps[p]],
            "speed_tokens_padded_per_step": [r["tokens_padded"] for r in speed_steps[p]]}
    result.update(_ratios({p: v["tokens_per_s"] for p, v in result["policies"].items()}))
    ours_rows = measured.get(OURS) or next(iter(measured.values()))
    result["samples_per_rank_per_step"] = {
        "mean": statistics.mean(r["samples"] for r in ours_rows) / args.nproc,
        "max_on_a_rank_ours": max(r["samples_per_rank_max"] for r in ours_rows)}
    drawn = [s for s in windows[args.warmup // W:]]
    tokens_N = np.concatenate([s.tokens_N for s in drawn])
    longer = tokens_N > SETS["data.micro_batch_tokens"]
    result["no_sp"] = {
        "samples_longer_than_a_micro_batch": int(longer.sum()), "samples": len(tokens_N),
        "tokens_a_no_sp_run_would_truncate": int((tokens_N[longer]
                                                  - SETS["data.micro_batch_tokens"]).sum()),
        "tokens": int(tokens_N.sum())}
    return result


def _ratios(tps: dict[str, float]) -> dict:
    """Ours over each policy, over the static layout(s) and over the best per-step one."""
    out: dict = {}
    if OURS not in tps:
        return out
    out["ratio_vs"] = {p: tps[OURS] / v for p, v in tps.items() if p != OURS}
    static = [p for p in STATIC if p in tps]
    per_step = [p for p in PER_STEP if p in tps]
    if static:
        best_static = max(static, key=tps.__getitem__)
        out["ratio_vs_static"] = tps[OURS] / tps[best_static]
        out["best_static"] = best_static
    if per_step:
        best = max(per_step, key=tps.__getitem__)
        out["ratio_vs_best_per_step"] = tps[OURS] / tps[best]
        out["best_per_step"] = best
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> dict:
    from omniscale.tools.bench.e2e import calibrate, run, train
    from omniscale.tools.bench.long_tail_turns import turns_round
    from omniscale.tools.bench.provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "omniscale-bench")
    ap.add_argument("--scale", default="small", choices=tuple(LONG_DOCS))
    ap.add_argument("--steps", type=int, default=None,
                    help="separate: steps of each run (default 12); interleaved: refused, the "
                         "run's length follows from --warmup, --window, the policies and "
                         "--cycles")
    ap.add_argument("--warmup", type=int, default=4,
                    help="steps left out (a whole window: the planner moves samples within "
                         "it); from the second on they measure the run's speed for the model "
                         "check (model_agreement)")
    ap.add_argument("--window", type=int, default=4,
                    help="global batches the plane plans together (data.window; --quick: 2)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--schedule", choices=("separate", "interleaved"), default="interleaved",
                    help="separate: one run per policy a round; interleaved: each run plans "
                         "its windows by the policies in turn, one run per rotation a round "
                         "(tools/bench/long_tail_turns.py), --steps then following from "
                         "--warmup, --window, the policies and --cycles")
    ap.add_argument("--cycles", type=int, default=1,
                    help="interleaved: each policy's turns (of one window) per run")
    e2e_interleave.add_rotations_argument(ap)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="decode processes per rank")
    ap.add_argument("--costs", default="calibrate",
                    help="the cost model of every run: calibrate (time the model on this "
                         "workload first, the default), a cost file of `omniscale balance "
                         "calibrate`, or flops (no calibration and no prediction: --quick)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--max-foreign", type=float, default=0.1,
                    help="a run during which other processes took more than this share of "
                         "the CPUs is contended: it is run again (--retries), and before each "
                         "run the bench waits until they take less")
    ap.add_argument("--wait-quiet-s", type=float, default=900,
                    help="how long to wait for the machine to be quiet before a run")
    ap.add_argument("--retries", type=int, default=2,
                    help="runs again of a contended run (each kept in the JSON)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "e2e_long_tail.json")
    args = ap.parse_args(argv)
    interleaved = args.schedule == "interleaved"
    if interleaved:
        if len(args.policies.split(",")) < 2 or args.cycles < 1:
            ap.error("--schedule interleaved: two or more policies and --cycles >= 1")
        e2e_interleave.check_rotations(ap, args.rotations, len(args.policies.split(",")))
        if args.steps is not None:
            ap.error(f"--steps {args.steps}: with --schedule interleaved a run's length follows "
                     "from --warmup, --window, the policies and --cycles (--schedule separate "
                     "takes --steps)")
        args.steps = e2e_interleave.steps_per_run(args.warmup, args.window,
                                                  len(args.policies.split(",")), args.cycles)
    if args.nproc != SP:
        raise SystemExit(f"--nproc {args.nproc}: this workload is one SP group of {SP} ranks")
    if args.steps is None:
        args.steps = 12
    if args.window < 1 or args.warmup % args.window or args.steps % args.window \
            or args.steps <= args.warmup:
        raise SystemExit(f"--warmup and --steps: multiples of the window ({args.window}), "
                         "steps > warmup")
    # what tools/bench/e2e.py's run and calibrate read
    args.micro_batch_tokens = SETS["data.micro_batch_tokens"]
    args.global_batch_tokens = SETS["data.global_batch_tokens"]
    policies = args.policies.split(",")
    args.policies_list = policies
    started = provenance()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    spec = prepare(args.data, args.scale)
    calibration = None
    if args.costs == "calibrate":
        args.costs = str(args.data / f"costs-long-tail-{args.scale}-{MICRO_BATCH_TOKENS}.json")
        failed = []
        for attempt in range(args.retries + 1):
            quiet = wait_quiet(args.max_foreign, args.wait_quiet_s)
            try:
                with Contention() as contention:
                    calibration = calibrate(spec, args)
            except SystemExit as e:  # a calibration that crashed: said, kept, tried again
                print(str(e)[-600:], flush=True)
                failed.append(str(e)[-600:])
                if attempt == args.retries:
                    raise
                continue
            calibration.update(foreign_cpu_share=round(contention.share, 3), failed=failed,
                               **quiet)
            if contention.share <= args.max_foreign:
                break
            print(f"other processes took {contention.share:.0%} of the CPUs while "
                  "calibrating", flush=True)
    # FLOP-based costs are no seconds: nothing to predict step times with
    prediction = predict(spec, None if args.costs == "flops" else args.costs, args)
    predicted = prediction.get("policies", {})
    print("predicted (same windows, this cost model): " + ("  ".join(
        f"{p} {v['tokens_per_s']:.0f} tok/s" for p, v in predicted.items())
        or prediction.get("skipped", "-")), flush=True)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="omniscale-e2e-long-") as tmp:
        for r in range(args.rounds):
            if interleaved:
                got = turns_round(r, policies, spec, Path(tmp), args, predicted, train)
                rounds.append({**got, **_ratios({p: v[RATE] for p, v in got["runs"].items()})})
                continue
            order = policies[r % len(policies):] + policies[:r % len(policies)]
            runs = {}
            for policy in order:
                discarded = []
                for attempt in range(args.retries + 1):
                    out = Path(tmp) / f"r{r}-{policy}-{attempt}"
                    quiet = wait_quiet(args.max_foreign, args.wait_quiet_s)
                    with Contention() as contention:
                        stats = run(policy, spec, out, args)
                    rows = _rows(out)
                    stats.update(_measured(rows[args.warmup:args.steps], predicted.get(policy),
                                           rows[SPEED_FROM:args.warmup]),
                                 foreign_cpu_share=round(contention.share, 3), **quiet)
                    print(f"round {r + 1}/{args.rounds} {policy:10s} "
                          f"{stats[RATE]:8.0f} tok/s  step {stats['step_s_median']:.3f} s  "
                          f"micro-batches {stats['micro_batches_mean']:.2f}  imbalance "
                          f"measured {stats['imbalance_measured']:.3f}  measured/predicted "
                          f"{stats['measured_over_predicted']:.2f}  other processes "
                          f"{contention.share:.0%} of the CPUs", flush=True)
                    if contention.share <= args.max_foreign:
                        break
                    discarded.append(stats)
                runs[policy] = {**stats, "contended": contention.share > args.max_foreign,
                                "discarded_contended_runs": discarded}
                if args.out:  # so far, in case a later run fails
                    partial = args.out.with_suffix(".partial.json")
                    partial.write_text(json.dumps({"prediction": prediction,
                                                   "calibration": calibration,
                                                   "rounds": rounds + [{"runs": runs}]}) + "\n")
            rounds.append({"order": order, "runs": runs,
                           **_ratios({p: v[RATE] for p, v in runs.items()})})
    summary = {p: {k: statistics.median(r["runs"][p][k] for r in rounds)
                   for k in (RATE, "tokens_per_s", "step_s_median", "imbalance_measured",
                             "imbalance_predicted", "micro_batches_mean",
                             "measured_over_predicted")} for p in policies}
    for p in policies:  # where every round measured the run's speed (warm-up of two steps or more)
        key = f"measured_over_predicted{AT_RUN_SPEED}"
        if all(key in r["runs"][p] for r in rounds):
            summary[p][key] = statistics.median(r["runs"][p][key] for r in rounds)
    measured = {}
    rates = [{p: v[RATE] for p, v in r["runs"].items()} for r in rounds]
    for key, group in (("static", STATIC), ("best_per_step", PER_STEP)):
        # the one layout / policy with the highest median rate, paired by round
        # (tools/bench/paired.py); each round's fastest kept beside it
        got = paired_ratios(rates, OURS, [p for p in group if p in policies])
        if got:
            measured[f"ratio_vs_{key}"] = {**_spread(got["ratios"]), "against": got["best"]}
            measured[f"ratio_vs_{key}_each_rounds_fastest"] = _spread(
                got["ratios_vs_fastest_each_round"])
    measured["ratio_vs"] = {p: _spread([r["ratio_vs"][p] for r in rounds])
                            for p in policies if p != OURS and OURS in policies}
    same_tokens = all(r["runs"][p]["tokens_as_predicted"]
                      and r["runs"][p].get("speed_steps_tokens_as_predicted", True)
                      for r in rounds for p in policies)
    targets = {}
    for key, goal in TARGETS.items():
        got = measured.get(f"ratio_{key}", {}).get("median")
        targets[key] = {"target": goal, "measured_median": got,
                        "measured_min": measured.get(f"ratio_{key}", {}).get("min"),
                        "measured_max": measured.get(f"ratio_{key}", {}).get("max"),
                        "predicted": prediction.get(f"ratio_{key}"),
                        "held": got is not None and got >= goal}
    targets["model_agreement"] = model_agreement(rounds)
    result = {"command": " ".join(["tools/bench/e2e_long_tail.py"] + (argv or sys.argv[1:])),
              **started, "load_avg_at_end": os.getloadavg(), "scale": args.scale,
              "nproc": args.nproc, "steps": args.steps, "warmup": args.warmup,
              "schedule": args.schedule, "cycles": args.cycles if interleaved else None,
              "rotations": e2e_interleave.runs_a_round(args, policies) if interleaved else None,
              "window": args.window, "sets": SETS,
              "weights": WEIGHTS,
              "long_docs": {"count": LONG_DOCS[args.scale], "min_tokens": MIN_TOKENS,
                            "max_tokens": MAX_TOKENS},
              "rate": RATE, "max_foreign_cpu_share": args.max_foreign,
              "contended_runs": sum(v["contended"] for r in rounds for v in r["runs"].values()),
              "costs": args.costs, "calibration": calibration,
              "rounds": rounds, "median": summary, "measured": measured,
              "prediction": prediction, "prediction_draws_the_runs_tokens": same_tokens,
              "targets": targets}
    for p in policies:
        s = summary[p]
        pred = predicted.get(p, {}).get("tokens_per_s")
        print(f"{p:10s} {s[RATE]:8.0f} tok/s (predicted {_fmt(pred, '8.0f')})  step "
              f"{s['step_s_median']:.3f} s  imbalance measured {s['imbalance_measured']:.3f}")
    agree = targets.pop("model_agreement")
    for key, t in targets.items():
        print(f"ours {key.replace('_', ' ')}: {_fmt(t['measured_median'], '.3f')}x measured "
              f"(median of {len(rounds)} rounds), {_fmt(t['predicted'], '.3f')}x predicted; target "
              f">= {t['target']}: {'held' if t['held'] else 'MISSED'}")
    fast = agree["at_run_speed"]
    print(f"ours measured/predicted: {agree['measured_over_predicted']:.3f} with the cost "
          f"file as calibrated, {fast['measured_over_predicted']:.3f} at the run's speed "
          f"(steps {SPEED_FROM}-{args.warmup - 1}; median of {len(rounds)} rounds; steps "
          f"{fast['step_min']:.2f}-{fast['step_max']:.2f}); target within "
          f"{agree['within']:.0%}: {'held' if agree['held'] else 'MISSED'}")
    targets["model_agreement"] = agree
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    return result


if __name__ == "__main__":
    main()
