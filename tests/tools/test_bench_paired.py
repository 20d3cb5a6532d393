"""The e2e benches' headline: ours against the one baseline with the best median rate, paired by
round (tools/bench/paired.py), and the per-round-fastest figure kept beside it."""

from __future__ import annotations

import json

import pytest

from omniscale.tools.bench import e2e
from omniscale.tools.bench.paired import best_by_median, paired_ratios

# Three rounds; b is the better policy (medians a 100, b 105, c 96), but c was fastest once.
RATES = [{"ours": 110, "a": 100, "b": 105, "c": 120},
         {"ours": 99, "a": 90, "b": 110, "c": 80},
         {"ours": 100, "a": 101, "b": 100, "c": 96}]


def test_the_best_baseline_is_the_one_with_the_highest_median():
    assert best_by_median(RATES, ["a", "b", "c"]) == "b"
    assert best_by_median(RATES, ["a", "c"]) == "a"  # medians 100 and 96
    assert best_by_median([], ["a"]) is None


def test_ratios_pair_each_round_with_that_baseline_and_keep_each_rounds_fastest():
    got = paired_ratios(RATES, "ours", ["a", "b", "c"])
    assert got["best"] == "b"
    assert got["ratios"] == pytest.approx([110 / 105, 99 / 110, 100 / 100])
    assert got["fastest_each_round"] == ["c", "b", "a"]
    assert got["ratios_vs_fastest_each_round"] == pytest.approx([110 / 120, 99 / 110, 100 / 101])


def test_a_round_without_ours_or_any_baseline_is_left_out():
    rates = RATES + [{"a": 500}, {"ours": 1}]
    assert paired_ratios(rates, "ours", ["a", "b", "c"]) == paired_ratios(RATES, "ours",
                                                                          ["a", "b", "c"])
    assert paired_ratios([{"ours": 1}], "ours", ["a"]) == {}


def test_summarize_recomputes_a_written_json_from_its_rounds(tmp_path):
    runs = [{p: {"tokens_per_s": float(v)} for p, v in r.items()} for r in RATES]
    old = {"command": "tools/bench/e2e.py --rounds 3", "git_commit": "abc", "git_dirty": False,
           "median": {p: {} for p in ("omniscale", "a", "b", "c")},
           "rounds": [{"order": [], "runs": {("omniscale" if p == "ours" else p): v
                                             for p, v in r.items()},
                       "best_baseline": "c", "ratio_vs_best_baseline": 0.5} for r in runs],
           "ratio_vs_best_baseline": {"median": 0.5, "min": 0.5, "max": 0.5}}
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(old))
    e2e.main(["--summarize", str(path)])
    doc = json.loads(path.read_text())
    assert doc["git_commit"] == "abc"  # the measurement's commit stays
    assert doc["summarized"]["command"] == f"tools/bench/e2e.py --summarize {path}"
    assert doc["best_baseline"] == "b"
    assert doc["ratio_vs_best_baseline"] == pytest.approx(
        {"median": 1.0, "min": 99 / 110, "max": 110 / 105})
    assert doc["ratio_vs_each_rounds_fastest_baseline"]["median"] == pytest.approx(110 / 120)
    assert doc["fastest_baseline_each_round"] == ["c", "b", "a"]
    assert all("best_baseline" not in r for r in doc["rounds"])
