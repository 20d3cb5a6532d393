"""The even workload's policies timed in turns inside each run, window by window.

On this machine the speed drifts by up to 1.7x over tens of seconds (another tenant of the host:
a fixed matmul loop took 0.17 s, then 0.29 s for half a minute, then 0.17 s again), so two
whole runs a minute apart can differ by ±15 % whatever their policy. Here each run plans its
windows by the policies in turn (``data.balance_interleave``; the trainer names each step's
policy in its metrics row): a drift of a few seconds slows one turn, one of minutes slows every
policy's turns alike.

The policies' turns hold different data within one run (window k is drawn whoever places it),
so a *round* is one run per rotation of the turn order: run j plans window k by policy
``(j + k) mod n``, and over the round every policy has trained every measured window once --
the same samples, in turns interleaved in time. A policy's figures in a round are over all its
turns in the round's runs (tokens over summed step time), and the round's ratio pairs
policies on identical data. The first ``warmup`` steps of every run are left out (compilation,
the first decodes) whoever planned them.
"""

from __future__ import annotations

from omniscale.tools.bench.contention import Contention, wait_quiet


def steps_per_run(warmup: int, window: int, n_policies: int, cycles: int) -> int:
    """Warm-up, then ``cycles`` turns of one window for each policy."""
    return warmup + window * n_policies * cycles


def rotation(policies: list[str], j: int) -> list[str]:
    """Run ``j``'s turn order: window k is planned by its (k mod n)-th policy (the separate
    schedule's order of runs in round ``j`` too)."""
    j %= len(policies)
    return policies[j:] + policies[:j]


def interleave_setting(order: list[str]) -> str:
    """``--set`` of ``data.balance_interleave`` (a YAML list)."""
    return "[" + ",".join(order) + "]"


def rows_by_policy(rows: list[dict], warmup: int, policies: list[str]) -> dict[str, list[dict]]:
    """The measured rows (step >= ``warmup``) of each policy, by the policy the row names;
    SystemExit when a row names none of them (a trainer that does not interleave)."""
    got: dict[str, list[dict]] = {p: [] for p in policies}
    for row in rows:
        if row["step"] < warmup:
            continue
        if row.get("balance") not in got:
            raise SystemExit(f"step {row['step']}: planned by {row.get('balance')!r}, none of "
                             f"the interleaved policies {policies}")
        got[row["balance"]].append(row)
    return got


def check_same_data(stats: dict[str, dict]) -> None:
    """A round's policies trained the same samples: their token counts agree (else the
    ratios would compare different data, and the round is refused in one line)."""
    tokens = {p: s["tokens"] for p, s in stats.items()}
    if len(set(tokens.values())) > 1:
        raise SystemExit(f"the round's policies trained different tokens {tokens}: its turns "
                         "did not cover the same windows")


def add_rotations_argument(ap) -> None:
    """``--rotations N``, the same flag for every workload run in turns."""
    ap.add_argument("--rotations", type=int, default=None,
                    help="interleaved: runs a round, the first N rotations of the turns "
                         "(default: one per policy, so every policy trains every window once; "
                         "fewer leaves the policies on different windows: a quick check only)")


def check_rotations(ap, rotations: int | None, n_policies: int) -> None:
    """``--rotations`` from 1 to the number of policies, or ``ap.error`` in one line."""
    if rotations is not None and not 1 <= rotations <= n_policies:
        ap.error(f"--rotations {rotations}: from 1 to the number of policies")


def runs_a_round(args, policies: list[str]) -> int:
    """Runs in a round of turns: ``--rotations``, else one per policy (every policy plans every
    window once, so the round's policies are paired on the same samples)."""
    return args.rotations or len(policies)


def run_rotation(r: int, j: int, policies: list[str], train, policy: str, spec, out, args,
                 sets: dict | None = None, **train_kwargs) -> tuple[list[dict], dict]:
    """Run ``j`` of round ``r``: one training run whose windows the policies plan in the turn
    order ``rotation(policies, r + j)``, after waiting for a quiet machine (``args.max_foreign``,
    ``args.wait_quiet_s``). ``train``: ``e2e.train``'s signature, called with ``policy`` (the
    run's ``data.balance``; its turns decide every window), ``sets`` and ``train_kwargs`` (the
    uneven workload's ``env`` and ``during``). Its metrics rows, and the run's record: ``order``,
    ``foreign_cpu_share`` and the wait."""
    order = rotation(policies, r + j)
    quiet = wait_quiet(args.max_foreign, args.wait_quiet_s)
    with Contention() as contention:
        rows = train(policy, spec, out, args, sets={
            **(sets or {}), "data.balance_interleave": interleave_setting(order)},
            **train_kwargs)
    return rows, {"order": order, "foreign_cpu_share": round(contention.share, 3), **quiet}
