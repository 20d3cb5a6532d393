"""The mutation score and its table (``tools/bench/mutation_table.py``) on hand-computed reports."""

from __future__ import annotations

import pytest

from omniscale.tools.bench.mutation_table import MARKERS, fill, score, table


def _result(killed=15, timed_out=1, errors=1, survivors=()):
    return {"generated": 140, "sampled": 20, "killed": killed, "timed_out": timed_out,
            "errors": errors, "survived": len(survivors), "survivors": list(survivors)}


SURVIVORS = ({"reason": "equivalent: sort_keys only orders the keys, which nobody reads"},
             {"reason": "needs a test: a log whose first byte is a newline"},
             {"reason": ""})


def test_score_leaves_equivalent_and_broken_runs_out_and_counts_hangs_as_killed():
    # 20 sampled, 1 could not run, 1 survivor equivalent: 18 judged; 15 killed + 1 hang = 16
    s = score("dataplane/mixer.py", _result(survivors=SURVIVORS))
    assert (s["killed"], s["equivalent"], s["open"], s["judged"]) == (16, 1, 2, 18)
    assert s["score"] == pytest.approx(16 / 18) and s["met"] is True  # 88.9 % >= 85 %


def test_a_critical_module_needs_every_survivor_explained():
    s = score("dataplane/journal.py", _result(survivors=SURVIVORS))
    assert s["score"] > 0.85 and s["met"] is False  # two open survivors
    explained = [{"reason": "equivalent: the offset is never above the size"}] * 3
    assert score("dataplane/journal.py", _result(survivors=explained))["met"] is True


def test_under_the_target_is_missed():
    # 10 killed + 0 hangs of 20 - 0 errors - 0 equivalent: 50 %
    s = score("balancer/pack.py", _result(killed=10, timed_out=0, errors=0,
                                          survivors=[{"reason": ""}] * 10))
    assert s["score"] == 0.5 and s["met"] is False


def test_the_table_has_a_row_per_module_and_says_which_did_not_run():
    report = {"seed": 0, "max_mutants": 100, "tool": {"name": "cosmic-ray", "version": "8.7.0"},
              "seconds": 3600, "git_commit": "0123456789abcdef", "git_dirty": False,
              "command": "tools/bench/mutation.py --jobs 2",
              "modules": {"dataplane/journal.py": _result(survivors=SURVIVORS),
                          "loaders/chat.py": {"error": "the tests fail unmutated: boom"},
                          # re-run alone later (--update), from a tree with changes
                          "balancer/pack.py": {**_result(), "git_commit": "fedcba9876543210",
                                               "git_dirty": True}}}
    rows = table(report)
    journal = next(r for r in rows if "`dataplane/journal.py`" in r)
    assert journal == ("| `dataplane/journal.py` | 140 | 20 | 16 | 0 | 1 | 2 | 88.9% | "
                       ">= 85%, none open | NO | `0123456` |")
    chat = next(r for r in rows if "`loaders/chat.py`" in r)
    assert "not run: the tests fail unmutated: boom" in chat and chat.endswith("`0123456` |")
    assert next(r for r in rows if "`balancer/pack.py`" in r).endswith("| `fedcba9`+ |")
    assert rows[-1] == ("Seed 0, at most 100 mutants per module, cosmic-ray 8.7.0; the last run "
                        "(`tools/bench/mutation.py --jobs 2`) took 60 minutes. Each row names "
                        "the commit its module was mutated at (`+` with uncommitted changes).")


def test_fill_replaces_only_between_the_markers():
    page = f"# Testing\n\nprose\n\n{MARKERS[0]}\nold table\n{MARKERS[1]}\nafter\n"
    filled = fill(page, None)
    assert filled == (f"# Testing\n\nprose\n\n{MARKERS[0]}\nNo committed "
                      f"`docs/bench/mutation.json` yet.\n{MARKERS[1]}\nafter\n")
    assert fill(filled, None) == filled
    with pytest.raises(ValueError, match="markers"):
        fill("# Testing\n", None)


def test_a_survivor_the_slow_tests_kill_counts_as_killed():
    # as before, but the open "needs a test" survivor is killed by the module's slow tests
    survivors = [SURVIVORS[0], {**SURVIVORS[1], "slow_tests": "killed"},
                 {**SURVIVORS[2], "slow_tests": "survived"}]
    s = score("dataplane/journal.py", _result(survivors=survivors))
    assert (s["killed"], s["equivalent"], s["open"], s["judged"]) == (17, 1, 1, 18)


def test_a_crashed_run_counts_as_killed():
    s = score("balancer/assign.py", {**_result(survivors=SURVIVORS), "crashed": 2,
                                     "sampled": 22})
    assert (s["killed"], s["judged"]) == (18, 20)  # 15 + 1 hang + 2 crashes of 22 - 1 - 1


def test_a_survivor_a_later_test_kills_counts_as_killed_and_is_shown_apart():
    survivors = [SURVIVORS[0], {"reason": "killed by tests/dataplane/test_x.py::test_y"},
                 SURVIVORS[2]]
    s = score("dataplane/journal.py", _result(survivors=survivors))
    # 15 + 1 hang + 1 killed later of 20 - 1 error - 1 equivalent
    assert (s["killed"], s["killed_later"], s["equivalent"], s["open"], s["judged"]) == \
        (17, 1, 1, 1, 18)
