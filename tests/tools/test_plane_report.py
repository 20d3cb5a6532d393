"""The plane bench's planning rows: judged against 2 steps/s at 4,096 ranks, information at
other sizes, and an older JSON (one planning run, no phases) still renders."""

from __future__ import annotations

from omniscale.tools.bench.plane_report import report


def _run(dp: int, steps_per_s: float) -> dict:
    return {"dp": dp, "samples_per_step": 8 * dp, "plan_s_per_window": 0.1,
            "total_s_per_window": 4 / steps_per_s, "steps_per_s": steps_per_s,
            "job_steps_per_s": 2.0, "s_per_window": {"draw": 1.0, "plan": 0.1},
            "memory": {"plane_bytes_estimate": 3 * 2 ** 30}}


def test_planning_rows_judge_the_4096_rank_job():
    rows = report({"planning": [_run(1024, 1.5), _run(4096, 0.4), _run(16384, 0.1)]})
    by_dp = {r["what"].split(":")[1].split(" ranks")[0].strip(): r for r in rows}
    assert by_dp["4,096"]["target"] == ">= 2 steps/s" and by_dp["4,096"]["met"] is False
    assert by_dp["1,024"]["target"] == "(information)" and by_dp["1,024"]["met"] is True
    assert by_dp["16,384"]["target"] == "(information)"
    assert "plane ~3,072 MiB" in by_dp["4,096"]["measured"]
    assert report({"planning": [_run(4096, 2.5)]})[0]["met"] is True


def test_an_older_single_planning_run_still_renders():
    old = {"dp": 1024, "samples_per_step": 8192, "plan_s_per_window": 0.8,
           "total_s_per_window": 1.1, "steps_per_s": 3.6}
    (row,) = report({"planning": old})
    assert row["target"] == "(information)" and "plan 800" in row["measured"]


def test_the_measured_peer_s_rows_divide_its_workers_by_ours():
    mib = 2 ** 20
    line = {"bytes_per_process": 90 * mib, "workers_bytes": 256 * 90 * mib, "processes": 256}
    energon = {"sources": 1000, "shards": 10, "workers": line,
               "bare": {"bytes_per_process": 60 * mib}, "ratio": 256 * 90 / 1000,
               "state_only": {"energon_bytes": 256 * 30 * mib, "ratio": 256 * 30 / 500},
               "per_shard_check": {"bytes_per_worker": {"10": 100.0, "1000": 101.0},
                                   "growth": 0.01}}
    side = {"extrapolated_bytes": 1000 * mib, "bytes_per_process": 1.0, "processes": 256,
            "measured": {"1": 1, "2": 2}}
    mem = {"baseline": side, "ours": side, "plane_bytes": 500 * mib, "ratio": 1.0,
           "state_only": {"baseline_bytes": 1.0, "ours_bytes": 500 * mib, "ratio": 1.0},
           "energon": energon}
    rows = report({"memory": mem})
    peer, state = rows[2], rows[3]
    assert peer["value"] == "23.04x" and "23,040 MiB (90.0 MiB/worker" in peer["baseline"]
    assert "+1.0% from 10 to 1,000 samples/shard" in peer["baseline"]
    assert peer["measured"] == "1,000 MiB" and "1,000 sources x 10 shards" in peer["what"]
    assert state["value"] == "15.4x" and state["measured"] == "500 MiB"
