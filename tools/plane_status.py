"""``omniscale plane status URL``: a running plane's status dict as a few rich tables.

Reads only the dict ``DataPlane.status()`` returns (see dataplane/status.py), so the same
rendering works for a status fetched over the wire or taken in-process.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

STEPS_SHOWN = 4  # trained and upcoming steps shown either side of the next step


def print_status(status: dict, console: Console | None = None) -> None:
    """Print a header line, then the mixture, sources, recent steps and clients."""
    if console is None:
        # Piped output (logs, CI, tests) keeps whole rows instead of wrapping at 80 columns.
        console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(_header(status), highlight=False)
    console.print(_mixture(status))
    console.print(_sources(status))
    console.print(_steps(status))
    for line in _footer(status):
        console.print(line, highlight=False)


def _header(s: dict) -> str:
    clients = s.get("clients", [])
    window = s.get("client_window_s", 60)
    return (f"plane {s['spec']}: next step {s['next_step']}, dp {s['dp']}, planned through "
            f"{s['planned_through']} ({s['plans_ahead']} steps ahead), {len(clients)} "
            f"client(s) in the last {window:g} s")


def _mixture(s: dict) -> Table:
    table = Table(title=f"mixture ({s['accounting']}, as drawn through step "
                        f"{s['mixture_through_step']})")
    table.add_column("source")
    for col in ("weight", "target share", "realized share", "deviation"):
        table.add_column(col, justify="right")
    for row in s["mixture"]:
        table.add_row(row["source"], f"{row['weight']:.4f}", f"{row['target_share']:.4f}",
                      f"{row['realized_share']:.4f}", f"{row['deviation']:+.4f}")
    return table


def _sources(s: dict) -> Table:
    table = Table(title="sources (served = drawn into plans)")
    table.add_column("source")
    columns = ("epoch", "served samples", "served tokens", "skipped", "quarantined")
    for col in columns:
        table.add_column(col, justify="right")
    table.add_column("state")
    for row in s["sources"]:
        skipped = (row["skipped_corrupt"] + row["skipped_quarantined"]
                   + row["skipped_too_long"])
        state = "exhausted" if row["exhausted"] else f"on exhaustion: {row['on_exhausted']}"
        table.add_row(row["source"], str(row["epoch"]), f"{row['served_samples']:,}",
                      f"{row['served_tokens']:,}", f"{skipped:,}", f"{row['quarantined']:,}",
                      state)
    return table


def _steps(s: dict) -> Table:
    table = Table(title="steps in memory: predicted cost per rank (max/mean = imbalance)")
    table.add_column("step", justify="right")
    for col in ("dp", "max cost", "mean cost", "lower bound", "imbalance"):
        table.add_column(col, justify="right")
    table.add_column("state")
    nxt = s["next_step"]
    for row in s["recent_steps"]:
        if abs(row["step"] - nxt) > STEPS_SHOWN:
            continue
        state = "next" if row["step"] == nxt else "committed" if row["committed"] else ""
        table.add_row(str(row["step"]), str(row["dp"]), f"{row['max_cost']:.4g}",
                      f"{row['mean_cost']:.4g}", f"{row['lower_bound']:.4g}",
                      f"{row['imbalance']:.4f}", state)
    return table


def _footer(s: dict) -> list[str]:
    lines = []
    clients = s.get("clients", [])
    if clients:
        lines.append("clients: " + ", ".join(
            f"rank {c['rank']} at step {c['last_step']} ({c['seen_s_ago']:.1f} s ago)"
            for c in clients))
    cost = s.get("next_step_rank_cost") or []
    if cost:
        lines.append(f"step {s['next_step']} predicted cost per rank: min {min(cost):.4g}, "
                     f"max {max(cost):.4g} over {len(cost)} ranks")
    snap = s["snapshot"]
    last = "none yet" if snap["last_step"] < 0 else f"at step {snap['last_step']}"
    lines.append(f"snapshot {last} (every {snap['every']} steps) in {snap['state_dir']}")
    if s.get("exhausted_at") is not None:
        lines.append(f"the mixture is exhausted: the last step is {s['exhausted_at'] - 1}")
    for event in s.get("exhausted", []):
        lines.append(f"source {event['source']} exhausted at step {event['step']} "
                     f"({event['policy']})")
    if s.get("dropped"):
        lines.append("dropped sources: " + ", ".join(s["dropped"]))
    suspect = s.get("suspect") or {}
    if suspect.get("steps"):
        lines.append(f"suspect: {suspect['samples']} samples of {suspect['steps']} step(s) "
                     f"the trainer did not apply (quarantined); the latest:")
        lines += [f"  step {r['step']}: {r['source']}/{r['key']} ({r['shard']}): {r['reason']}"
                  for r in suspect["recent"][-5:]]
    stragglers = s.get("stragglers") or {}
    if stragglers.get("ranks"):
        lines.append(f"stragglers (the trainer, as of step {stragglers['step']}): " + ", ".join(
            f"data rank {r} at {v:.1f}× its predicted compute"
            for r, v in zip(stragglers["ranks"], stragglers["slowdown"])))
    return lines
