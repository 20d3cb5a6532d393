"""Ours against the best baseline over rounds of alternated runs: which baseline is "the best".

A user runs one policy for a whole job, so the baseline to beat is one policy: the one with the
highest median rate over the rounds. Each round's ratio is then ours over that policy in the
same round (the runs of a round are minutes apart, so the pair shares the machine's state),
and the headline is the median of those paired ratios.

Taking instead the fastest baseline of each round compares ours with the luckiest of several
noisy runs: on a machine whose speed drifts by ±10 % between runs, the maximum of four
baselines sits above their typical rate even when every policy is equally fast, so that figure
is biased against ours by the noise, not by the policies. It is kept beside the headline (a
conservative bound), labelled as what it is.
"""

from __future__ import annotations

import statistics


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def best_by_median(rates: list[dict[str, float]], candidates: list[str]) -> str | None:
    """The candidate with the highest median rate over the rounds that measured it (ties: the
    first listed); None when no round measured any."""
    medians = {p: statistics.median(r[p] for r in rates if p in r)
               for p in candidates if any(p in r for r in rates)}
    return max(medians, key=medians.__getitem__) if medians else None


def paired_ratios(rates: list[dict[str, float]], ours: str, candidates: list[str]) -> dict:
    """``rates``: per round, each policy's rate (higher is better). Returns ``best`` (by
    median), ``ratios`` (per round, ours over ``best``), ``fastest_each_round`` and
    ``ratios_vs_fastest_each_round`` (the conservative figure: ours over that round's fastest
    candidate). Empty when ours or every candidate is missing."""
    rounds = [r for r in rates if ours in r and any(p in r for p in candidates)]
    best = best_by_median(rounds, candidates)
    if best is None:
        return {}
    fastest = [max((p for p in candidates if p in r), key=r.__getitem__) for r in rounds]
    return {"best": best,
            "ratios": [r[ours] / r[best] for r in rounds if best in r],
            "fastest_each_round": fastest,
            "ratios_vs_fastest_each_round": [r[ours] / r[f] for r, f in zip(rounds, fastest)]}
