"""The long-tail workload's policies in turns inside each run: the even workload's schedule
(``tools/bench/e2e_interleave.py``) with the long-tail bench's prediction beside each policy.

Run ``j`` of round ``r`` plans window ``k`` by ``rotation(policies, r + j)[k mod n]``; over the
round's ``n`` runs every policy plans every measured window once, so a policy's rows, sorted by
step, are the steps the prediction lists for it. A drift of the machine's speed over minutes
then slows every policy's turns alike, where whole runs a minute apart took it one at a time
(the separate schedule: one run per policy a round).

The prediction at the run's own speed (``long_tail_model.at_run_speed``) scales each step by the
speed of the run it ran in: measured over predicted seconds on that run's warm-up steps (from
``SPEED_FROM``), which the rotation's first policy planned.
"""

from __future__ import annotations

from pathlib import Path

from omniscale.balancer.simulate import OURS
from omniscale.tools.bench import e2e_interleave
from omniscale.tools.bench.long_tail_model import (
    SPEED_FROM,
    _beside_prediction,
    at_run_speed,
)


def turns_round(r: int, policies: list[str], spec: Path, tmp: Path, args, predicted: dict,
                train) -> dict:
    """Round ``r``: one run per rotation of the turns (a contended run is run again, up to
    ``args.retries`` times, each attempt kept), then each policy's figures over its turns
    (``long_tail_model._measured`` fields, the run speed per step). ``train``: ``e2e.train``'s
    signature (``policy, spec, out, args, sets``) returning the run's metrics rows."""
    from omniscale.tools.bench.e2e import measured_stats

    rows: dict[str, list[dict]] = {p: [] for p in policies}
    scale: dict[tuple[str, int], float] = {}  # (policy, step) -> its run's speed scale
    warm_as_planned, each = [], []
    rotations = e2e_interleave.runs_a_round(args, policies)
    for j in range(rotations):
        order = e2e_interleave.rotation(policies, r + j)
        discarded = []
        for attempt in range(args.retries + 1):
            got, record = e2e_interleave.run_rotation(r, j, policies, train, OURS, spec,
                                                      tmp / f"r{r}-turns{j}-{attempt}", args)
            mine = e2e_interleave.rows_by_policy(got, args.warmup, policies)
            # the trainer's own count (split samples' padding included), for the progress line;
            # each policy's own rate (long_tail_model.RATE) is computed over its turns below
            run = {**record,
                   "tokens_per_s_trainer": {p: sum(x["tokens"] for x in mine[p])
                                            / sum(x["step_s"] for x in mine[p])
                                            for p in policies}}
            print(f"round {r + 1}/{args.rounds} run {j + 1}/{rotations} (turns "
                  f"{', '.join(order)}): " + "  ".join(
                      f"{p} {v:.0f}" for p, v in run["tokens_per_s_trainer"].items())
                  + f" tok/s  other processes {run['foreign_cpu_share']:.0%} of the CPUs",
                  flush=True)
            if run["foreign_cpu_share"] <= args.max_foreign:
                break
            discarded.append(run)
        each.append({**run, "contended": run["foreign_cpu_share"] > args.max_foreign,
                     "discarded_contended_runs": discarded})
        warm = got[SPEED_FROM:args.warmup]  # window 0: the rotation's first policy planned it
        first = predicted.get(order[0], {})
        if warm and len(warm) == len(first.get("speed_step_s", ())):
            run_scale = sum(x["step_s"] for x in warm) / sum(first["speed_step_s"])
            warm_as_planned.append([x["tokens"] for x in warm]
                                   == first["speed_tokens_padded_per_step"])
            scale.update({(p, x["step"]): run_scale for p in policies for x in mine[p]})
        for p in policies:
            rows[p] += mine[p]
    runs = {}
    for p in policies:
        mine = sorted(rows[p], key=lambda x: x["step"])
        stats = {**measured_stats(mine), "loss_last": mine[-1]["loss"],
                 **_beside_prediction(mine, predicted.get(p))}
        if "step_measured_over_predicted" in stats \
                and all((p, x["step"]) in scale for x in mine):
            stats.update(at_run_speed(stats, predicted[p], [scale[p, x["step"]] for x in mine]),
                         speed_steps_tokens_as_predicted=all(warm_as_planned))
        runs[p] = {**stats, "contended": any(e["contended"] for e in each)}
    # every policy's turns covered the same steps, so the same windows: the same samples (a
    # token count would differ by the padding each policy's splits add) -- over a whole
    # rotation; fewer runs (--rotations, a quick check) leave each policy its own windows
    steps = {p: sorted(x["step"] for x in rows[p]) for p in policies}
    if rotations == len(policies) and len({tuple(v) for v in steps.values()}) > 1:
        raise SystemExit(f"round {r + 1}: the policies' turns covered different steps "
                         f"{steps}: a trainer that does not follow data.balance_interleave")
    return {"order": [e["order"] for e in each], "runs": runs, "runs_each": each}

