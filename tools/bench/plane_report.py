"""The data-plane benchmark's table: each measurement against its target, with the in-run
baseline beside it (``tools/bench/plane.py`` measures; this renders)."""

from __future__ import annotations

# steps_per_s: what the plane must plan and serve for a 4,096-rank job (issue #44 item 5)
TARGETS = {"memory_ratio": 20.0, "fetches_per_s": 5000.0, "p99_ms": 20.0, "steps_per_s": 2.0,
           "steps_per_s_ranks": 4096}

MODES = ("action", "exchange", "lane")
LABEL = {"action": "per-call plan actions (PlaneClient default)",
         "exchange": "Flight exchange stream", "lane": "plan lane (PlaneClient(stream=True))"}


def serving_rows(srv: dict, rate: float) -> list[dict]:
    """Rows of the serving runs: the lane against the in-run baseline (per-call actions) and
    against the targets; the exchange stream and the closed loop's latency as information."""
    closed, paced = srv["closed"], srv["paced"]
    base, ours = closed["action"], closed["lane"]
    n = ours["clients"]
    rows = [{
        "what": f"serving, closed loop: fetches/s, {n} clients ({ours['processes']} processes)",
        "baseline": f"{base['fetches_per_s']:,.0f}/s {LABEL['action']}",
        "measured": f"{ours['fetches_per_s']:,.0f}/s {LABEL['lane']}; "
                    f"{ours['fetches_per_s'] / base['fetches_per_s']:.2f}x baseline, "
                    f"{ours['fetches_per_s'] / TARGETS['fetches_per_s']:.2f}x target",
        "value": f"{ours['fetches_per_s']:,.0f}/s", "target": ">= 5,000/s",
        "met": ours["fetches_per_s"] >= TARGETS["fetches_per_s"]}]
    if "lane" in paced and "action" in paced:
        base, ours = paced["action"], paced["lane"]
        rows.append({
            "what": f"serving, paced {rate:,.0f} fetches/s ({n} clients x "
                    f"{ours['rate_per_client']:.1f}/s): p99",
            "baseline": f"p99 {base['p99_ms']:,.1f} ms {LABEL['action']}",
            "measured": f"p50 {ours['p50_ms']:.2f} ms, "
                        f"p99.9 {ours['p99.9_ms']:.1f} ms; p99 "
                        f"{base['p99_ms'] / max(ours['p99_ms'], 1e-9):.1f}x lower than baseline,"
                        f" p99 / target {ours['p99_ms'] / TARGETS['p99_ms']:.2f}",
            "value": f"{ours['p99_ms']:.2f} ms", "target": "p99 <= 20 ms at the rate",
            "met": ours["p99_ms"] <= TARGETS["p99_ms"]})
    for load, runs in (("closed loop", closed), ("paced", paced)):
        for mode in MODES:
            if mode not in runs:
                continue
            r = runs[mode]
            rows.append({
                "what": f"serving, {load}, {mode}: latency p50 / p99 (information)",
                "baseline": "-",
                "measured": f"{r['fetches_per_s']:,.0f}/s "
                            f"{'scheduled' if r['rate'] else 'served'}, p50 "
                            f"{r['p50_ms']:.2f} ms; CPU per "
                            f"fetch: plane {r['plane_cpu_us_per_fetch']:.0f} us, clients "
                            f"{r['clients_cpu_us_per_fetch']:.0f} us; load avg "
                            f"{r['load_avg_before']:.1f}",
                "value": f"p99 {r['p99_ms']:.2f} ms",
                "target": "(Little's law: p99 <= 20 ms needs >= 12,800/s)"
                          if load == "closed loop" else "(information)", "met": True})
    return rows


def report(out: dict) -> list[dict]:
    rows = []
    if "memory" in out:
        mem = out["memory"]
        mib = 2 ** 20
        base, ours = mem["baseline"], mem["ours"]
        n = base["processes"]
        counts = sorted(int(k) for k in base.get("measured", {})) or [1, 8]  # --memory-procs
        rows.append(
            {"what": f"memory, {n} loader processes: per-rank state / (plane + clients), "
                     f"fitted from {counts[0]}-{counts[-1]} real processes",
             "baseline": f"{base['extrapolated_bytes'] / mib:,.0f} MiB "
                         f"({base['bytes_per_process'] / mib:.1f} MiB/process)",
             "measured": f"{ours['extrapolated_bytes'] / mib:,.0f} MiB "
                         f"({ours['bytes_per_process'] / mib:.1f} MiB/process, plane "
                         f"{mem['plane_bytes'] / mib:.0f} MiB)",
             "value": f"{mem['ratio']:.1f}x", "target": ">= 20x",
             "met": mem["ratio"] >= TARGETS["memory_ratio"]})
        state = mem["state_only"]
        rows.append(
            {"what": f"memory, {n} loader processes, state only (a bare process's PSS "
                     "subtracted per process): per-rank state / plane + clients",
             "baseline": f"{state['baseline_bytes'] / mib:,.0f} MiB",
             "measured": f"{state['ours_bytes'] / mib:,.0f} MiB",
             "value": f"{state['ratio']:.1f}x", "target": "(information)", "met": True})
        if "energon" in mem:
            rows += energon_rows(mem["energon"], ours, state)
    if "serving" in out:
        rows += serving_rows(out["serving"], out["serving"]["rate"])
    runs = out.get("planning", [])
    for pln in [runs] if isinstance(runs, dict) else runs:  # one run (older JSON) or a list
        rows.append(planning_row(pln))
    return rows


def energon_rows(energon: dict, ours: dict, state: dict) -> list[dict]:
    """The measured peer: what Energon's workers add for the job's loader processes against
    ours, whole processes and state alone (information: the 20x target is against per-rank
    catalogs)."""
    mib = 2 ** 20
    workers, n = energon["workers"], energon["workers"]["processes"]
    where = f"{energon['sources']:,} sources x {energon['shards']} shards"
    check = energon.get("per_shard_check")
    checked = (f"; per-worker PSS {check['growth'] * 100:+.1f}% from "
               + " to ".join(f"{int(p):,}" for p in check["bytes_per_worker"])
               + " samples/shard") if check else ""
    return [
        {"what": f"memory, {n} loader processes: Megatron-Energon's DataLoader workers "
                 f"(measured peer, {where} as tars; the ranks' main processes left out) / "
                 f"(plane + clients)",
         "baseline": f"{workers['workers_bytes'] / mib:,.0f} MiB "
                     f"({workers['bytes_per_process'] / mib:.1f} MiB/worker{checked})",
         "measured": f"{ours['extrapolated_bytes'] / mib:,.0f} MiB",
         "value": f"{energon['ratio']:.2f}x", "target": "(information)", "met": True},
        {"what": f"memory, {n} loader processes, state only: Energon's workers over {where} "
                 f"less its workers over one source / plane + clients",
         "baseline": f"{energon['state_only']['energon_bytes'] / mib:,.0f} MiB",
         "measured": f"{state['ours_bytes'] / mib:,.0f} MiB",
         "value": f"{energon['state_only']['ratio']:.1f}x", "target": "(information)",
         "met": True}]


def planning_row(pln: dict) -> dict:
    """A planning run: steps/s planned and served against the job's consumption; the target
    holds at 4,096 ranks (information at other sizes)."""
    phases = pln.get("s_per_window", {"plan": pln["plan_s_per_window"]})
    mem = pln.get("memory")
    judged = pln["dp"] == TARGETS["steps_per_s_ranks"]
    ramp = ", a linear ramp over tokens" if pln.get("schedule") == "tokens-ramp" else ""
    return {"what": f"planning: {pln['dp']:,} ranks, {pln['samples_per_step']:,} samples/step"
                    + ramp,
            "baseline": f"{pln.get('job_steps_per_s', 1.0):g} steps/s consumed",
            "measured": f"{pln['total_s_per_window'] * 1e3:,.0f} ms/window ("
                        + ", ".join(f"{k} {v * 1e3:,.0f}" for k, v in phases.items()) + ")"
                        + (f"; plane ~{mem['plane_bytes_estimate'] / 2 ** 20:,.0f} MiB"
                           if mem else ""),
            "value": f"{pln['steps_per_s']:.2f} steps/s",
            "target": f">= {TARGETS['steps_per_s']:g} steps/s" if judged else "(information)",
            "met": pln["steps_per_s"] >= TARGETS["steps_per_s"] if judged else True}


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="data plane: measured vs target (baselines measured in the same run)")
    for col in ("what", "baseline", "measured", "value", "target", "met"):
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row[c]) if c != "met" else ("yes" if row[c] else "NO")
                        for c in ("what", "baseline", "measured", "value", "target", "met")))
    Console(width=160).print(table)
