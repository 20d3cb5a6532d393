"""The end-to-end bench's uneven-ranks workload: one rank made slower, mid-run, by a process
outside the trainer.

Each rank is pinned to a CPU of its own (``OMNISCALE_CPU_BIND``). When the run's metrics show
step ``slow_from - 1`` done, a *neighbour* starts: a Python busy loop pinned to rank 1's CPU,
which then gets about half of that core -- a noisy neighbour, as a shared host or a throttled
device would give. At step ``slow_until`` it stops. Nothing inside the trainer knows: the
planner sees rank 1's speed only through its compute clock (runnable time on CPU: the turns
the neighbour takes count, waiting for rank 0 does not) and the speeds rank 0 tells the plane.
Every policy runs the same way; the baselines' plans are reported with the same speeds, but
they do not plan by them (they place each step by tokens or cost alone).

Per run: tokens/s over the slowed steps once settled (``settle`` steps after the change), the
measured time imbalance there, the fraction of a perfect speed-proportional split's tokens/s
it reaches (per step: the measured per-rank speeds, cost / compute seconds, give the ideal
compute time Σ cost / Σ speed; the step's other time -- optimizer, waits, data -- is kept as
measured), and the steps until the step time recovered (within 10% of its settled level after
the change; of its level before the change once the neighbour left), and the steps from each
change to the first step planned with speeds that saw it. ``settings.deterministic``
is off for every policy: plans that follow measured speeds depend on timing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

NEIGHBOUR_CODE = ("import os; os.sched_setaffinity(0, {%d}); print('ready', flush=True)\n"
                  "while True: pass")
SETS = {"deterministic": "false"}  # speed-aware plans are off in deterministic mode
RECOVERED = 1.10  # a step within 10% of the level it recovers to


def cpus() -> list[int]:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        raise SystemExit("the uneven workload pins two ranks to a CPU each: needs 2 CPUs")
    return mine[:2]


def environment() -> dict[str, str]:
    """The runs' environment: rank i on CPU i."""
    return {**os.environ, "OMNISCALE_CPU_BIND": ",".join(map(str, cpus()))}


def describe(slow_from: int, slow_until: int | None) -> dict:
    cpu = cpus()[1]
    return {"what": f"a Python busy loop pinned to CPU {cpu}, rank 1's (rank 0 on CPU "
                    f"{cpus()[0]}): about half that core", "code": NEIGHBOUR_CODE % cpu,
            "from_step": slow_from, "until_step": slow_until}


class Neighbour:
    """Starts the busy loop when the run reaches ``slow_from`` and stops it at ``slow_until``:
    a thread that follows the run's ``metrics.jsonl`` (rank 0 writes a row per step)."""

    def __init__(self, metrics: Path, slow_from: int, slow_until: int | None) -> None:
        self.metrics, self.slow_from, self.slow_until = metrics, slow_from, slow_until
        self.process: subprocess.Popen | None = None
        self.started_after = self.stopped_after = None  # the last step done at the time
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> "Neighbour":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        self._thread.join()
        self._stop()

    def _last_step(self) -> int:
        try:
            lines = self.metrics.read_text().splitlines()
        except FileNotFoundError:
            return -1
        return json.loads(lines[-1])["step"] if lines else -1

    def _follow(self) -> None:
        while not self._done.wait(0.05):  # a bench following a run, not a test's sync
            last = self._last_step()
            if self.process is None and self.started_after is None and \
                    last >= self.slow_from - 1:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", NEIGHBOUR_CODE % cpus()[1]],
                    stdout=subprocess.PIPE, text=True)
                self.process.stdout.readline()  # 'ready': spinning
                self.started_after = last
            if self.process is not None and self.slow_until is not None and \
                    last >= self.slow_until - 1:
                self._stop()
                self.stopped_after = last

    def _stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


def _ideal_step(row: dict) -> float:
    """The step with its compute spread in proportion to the ranks' measured speeds."""
    costs, secs = row["rank_predicted_cost"], row["rank_compute_s"]
    speeds = [c / s for c, s in zip(costs, secs) if c > 0 and s > 0]
    if len(speeds) < len(costs):
        return row["step_s"]
    return row["step_s"] - max(secs) + sum(costs) / sum(speeds)


def _recovery(step_s: list[float], start: int, level: float) -> int | None:
    """Steps from ``start`` until the first step within RECOVERED of ``level``."""
    for k, s in enumerate(step_s[start:]):
        if s <= RECOVERED * level:
            return k
    return None


def _adapted(rows: list[dict], change: int, slowed: bool) -> int | None:
    """Steps from ``change`` to the first step planned with speeds that saw it: uneven ones
    (``slowed``) or equal ones again; None if no such speeds were sent (a baseline)."""
    for row in rows:
        sent = row.get("rank_speeds_sent")
        if sent is None or row["step"] < change:
            continue
        uneven = bool(sent["speeds"]) and min(sent["speeds"]) < 0.9
        if uneven == slowed:
            return sent["applies_at_step"] - change
    return None


def analyse(rows: list[dict], slow_from: int, slow_until: int | None, settle: int,
            warmup: int, plans_by_speed: bool = True) -> dict:
    """One run's figures (module docstring) from its metrics rows. ``plans_by_speed``: False
    for a baseline policy, whose trainer sends the speeds all the same but whose plans do not
    follow them: no step is "planned for" a change then (None)."""
    end = slow_until if slow_until is not None else len(rows)
    settled = [r for r in rows if slow_from + settle <= r["step"] < end]
    if not settled:
        raise SystemExit(f"uneven workload: no settled steps between {slow_from + settle} "
                         f"and {end} (steps {len(rows)})")
    step_s = [r["step_s"] for r in rows]
    seconds = sum(r["step_s"] for r in settled)
    before = statistics.median(step_s[warmup:slow_from]) if slow_from > warmup else None
    level = statistics.median(r["step_s"] for r in settled)
    result = {
        "tokens_per_s": sum(r["tokens"] for r in settled) / seconds,
        "ideal_fraction": sum(_ideal_step(r) for r in settled) / seconds,
        "imbalance_measured": statistics.mean(r["imbalance_measured"] for r in settled),
        "step_s_before": before, "step_s_slowed": level,
        "recovery_steps": _recovery(step_s, slow_from, level),
        "rank1_speed_measured": statistics.median(
            (r["rank_predicted_cost"][1] / r["rank_compute_s"][1]) /
            (r["rank_predicted_cost"][0] / r["rank_compute_s"][0]) for r in settled),
        "steps": [{"step": r["step"], "step_s": round(r["step_s"], 3),
                   "rank1_share": round(r["rank_predicted_cost"][1]
                                        / max(sum(r["rank_predicted_cost"]), 1e-12), 3),
                   "rank_speed": r.get("rank_speed"),
                   "micro_batches": r["micro_batches"],
                   "sp_split_samples": r.get("sp_split_samples", 0)} for r in rows],
        "speeds_sent": [{"after_step": r["step"], **r["rank_speeds_sent"]} for r in rows
                        if "rank_speeds_sent" in r],
    }
    result["planned_for_slowdown_after_steps"] = \
        _adapted(rows, slow_from, True) if plans_by_speed else None
    if slow_until is not None and before is not None:
        result["recovery_after_release_steps"] = _recovery(step_s, slow_until, before)
        result["planned_for_release_after_steps"] = \
            _adapted(rows, slow_until, False) if plans_by_speed else None
    return result


# -- the policies in turns inside each run -----------------------------------------------------
# The separate schedule above compares runs minutes apart, and this machine's speed moves between
# them (the speed-proportional split's tokens/s ranged 3,400-4,530 over one round's runs). In
# turns, each run plans its windows by the policies in turn (``data.balance_interleave``), its
# neighbour as above, and a round is one run per rotation of the turn order: every policy plans
# every settled step once over the round, on the same samples, at times interleaved with the
# others'. Only ours plans by the speeds the plane hears; it hears them in every turn.


def policy_over_turns(runs: list[list[dict]], policy: str, slow_from: int,
                      slow_until: int | None, settle: int, warmup: int,
                      plans_by_speed: bool) -> dict:
    """``policy``'s figures over its turns in a round's runs (each run's metrics rows; a row
    names the policy that planned it, ``balance``): :func:`analyse`'s, the slowed settled steps
    pooled over the runs. The steps "planned for" a change: from the change to the first step
    *this policy* planned with the speeds that saw it (a turn of another policy may come
    between: the turn order's cost, not the plane's); ``speeds_applied_after_slowdown_steps``
    (and ``_release_``): from the change to the step the plane applies them from, whoever plans
    it. No ``recovery_steps``: a run's consecutive steps are other policies' too (the separate
    schedule measures them)."""
    from omniscale.tools.bench.e2e import phase_means

    mine = [[r for r in rows if r.get("balance") == policy] for rows in runs]
    end = slow_until if slow_until is not None else 1 + max(r["step"] for rows in runs
                                                            for r in rows)
    settled = [r for rows in mine for r in rows if slow_from + settle <= r["step"] < end]
    before = [r["step_s"] for rows in mine for r in rows if warmup <= r["step"] < slow_from]
    if not settled:
        raise SystemExit(f"uneven workload in turns: {policy} planned no settled step between "
                         f"{slow_from + settle} and {end}")
    seconds = sum(r["step_s"] for r in settled)
    result = {
        "tokens_per_s": sum(r["tokens"] for r in settled) / seconds,
        "tokens": sum(r["tokens"] for r in settled), "steps_measured": len(settled),
        "step_s_median": statistics.median(r["step_s"] for r in settled),
        "ideal_fraction": sum(_ideal_step(r) for r in settled) / seconds,
        "imbalance_measured": statistics.mean(r["imbalance_measured"] for r in settled),
        "imbalance_predicted": statistics.mean(r["imbalance_predicted"] for r in settled),
        "step_s_before": statistics.median(before) if before else None,
        "step_s_slowed": statistics.median(r["step_s"] for r in settled),
        "rank1_speed_measured": statistics.median(
            (r["rank_predicted_cost"][1] / r["rank_compute_s"][1]) /
            (r["rank_predicted_cost"][0] / r["rank_compute_s"][0]) for r in settled),
        # where the slowed steps' time went: the speed-proportional split's step is each
        # policy's own (its plans' work and overheads), so what differs between them shows here
        "ideal_step_s_mean": statistics.mean(_ideal_step(r) for r in settled),
        "compute_s_max_mean": statistics.mean(max(r["rank_compute_s"]) for r in settled),
        "predicted_cost_sum_mean": statistics.mean(sum(r["rank_predicted_cost"])
                                                   for r in settled),
        "micro_batches_mean": statistics.mean(r["micro_batches"] for r in settled),
        "sp_split_samples": sum(r.get("sp_split_samples", 0) for r in settled),
        "media_items_moved_mean": statistics.mean(r.get("media_items_moved", 0)
                                                  for r in settled),
        **phase_means(settled),
        "steps": [{"step": r["step"], "run": j, "step_s": round(r["step_s"], 3),
                   "rank1_share": round(r["rank_predicted_cost"][1]
                                        / max(sum(r["rank_predicted_cost"]), 1e-12), 3),
                   "rank_compute_s": [round(x, 3) for x in r["rank_compute_s"]],
                   "rank_predicted_cost": [round(x, 4) for x in r["rank_predicted_cost"]],
                   "micro_batches": r["micro_batches"], "tokens": r["tokens"],
                   "sp_split_samples": r.get("sp_split_samples", 0)}
                  for j, rows in enumerate(mine) for r in rows],
    }
    changes = [("slowdown", slow_from, True)] + (
        [("release", slow_until, False)] if slow_until is not None else [])
    for name, change, slowed in changes:
        applied = [_applies_at(rows, change, slowed) for rows in runs]
        known = [a for a in applied if a is not None]
        result[f"speeds_applied_after_{name}_steps"] = \
            statistics.median(a - change for a in known) if known else None
        planned = [next((r["step"] - change for r in m if r["step"] >= a), None)
                   for a, m in zip(applied, mine) if a is not None] if plans_by_speed else []
        planned = [p for p in planned if p is not None]
        result[f"planned_for_{name}_after_steps"] = \
            statistics.median(planned) if planned else None
    return result


def _applies_at(rows: list[dict], change: int, slowed: bool) -> int | None:
    """The step from which the plane plans with speeds that saw ``change`` (:func:`_adapted`'s
    step, as a step number)."""
    after = _adapted(rows, change, slowed)
    return None if after is None else change + after


def turns_round(r: int, policies: list[str], spec: Path, tmp: Path, args,
                slow_until: int | None, train, ours: str) -> dict:
    """Round ``r`` in turns: one run per rotation of the turn order (``args.rotations`` of
    them, default all), each with the neighbour; each policy's figures over its turns
    (:func:`policy_over_turns`). ``train``: ``e2e.train``'s signature, returning the run's
    metrics rows."""
    from omniscale.tools.bench import e2e_interleave

    runs, each = [], []
    rotations = e2e_interleave.runs_a_round(args, policies)
    for j in range(rotations):
        rows, record = e2e_interleave.run_rotation(
            r, j, policies, train, ours, spec, tmp / f"r{r}-turns{j}", args, sets=SETS,
            env=environment(), during=lambda m: Neighbour(m, args.slow_from, slow_until))
        e2e_interleave.rows_by_policy(rows, 0, policies)  # every row names one of them
        runs.append(rows)
        each.append({**record, "speeds_sent": [{"after_step": x["step"], **x["rank_speeds_sent"]}
                                               for x in rows if "rank_speeds_sent" in x]})
        print(f"round {r + 1}/{args.rounds} run {j + 1}/{rotations} (turns "
              f"{', '.join(record['order'])}) done  other processes "
              f"{record['foreign_cpu_share']:.0%} of the CPUs (the neighbour, the bench's own "
              "child, not counted)", flush=True)
    got = {p: policy_over_turns(runs, p, args.slow_from, slow_until, args.settle, args.warmup,
                                plans_by_speed=p == ours) for p in policies}
    # over a whole rotation every policy planned the same steps, so the same samples (tokens
    # would differ by the padding each policy's splits add)
    steps = {p: sorted(s["step"] for s in v["steps"]) for p, v in got.items()}
    if rotations == len(policies) and len({tuple(v) for v in steps.values()}) > 1:
        raise SystemExit(f"round {r + 1}: the policies' turns covered different steps {steps}: "
                         "a trainer that does not follow data.balance_interleave")
    for p, v in got.items():
        print(f"round {r + 1}/{args.rounds} {p:10s} {v['tokens_per_s']:8.0f} tok/s  ideal "
              f"{v['ideal_fraction']:.3f}  imbalance measured {v['imbalance_measured']:.3f}  "
              f"rank 1 speed {v['rank1_speed_measured']:.2f}", flush=True)
    return {"order": [e["order"] for e in each], "runs": got, "runs_each": each}
