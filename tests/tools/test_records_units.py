"""A log interval's metrics rows (``records.flush``), rule by rule (issue #46): the sums sliced
back per step, each rank's timing, the wall-clock step, samples skipped on two ranks counted
once, the host-sync and object-store fields. The two-rank gathers are handed in as
``collectives.flush_metrics`` returns them (rank 0's figures, then its peer's), so each row
can be checked against figures worked out by hand; the real collectives are exercised by the
training runs (tests/tools/test_step_audit.py, test_train.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omniscale.tools.train import collectives, records
from omniscale.tools.train.compute_clock import ComputeClock
from omniscale.tools.train.records import StepRecord, StepSums, step_record
from omniscale.tools.train.step import RunState


def test_step_sums_survive_the_flat_round_trip_with_the_expert_load():
    sums = StepSums(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]),
                    torch.tensor([5.0, 6.0]), torch.tensor([7.0, 8.0]), torch.tensor(9.0),
                    torch.tensor([[10, 11, 12], [13, 14, 15]]))
    flat = sums.flat()
    assert flat.tolist() == [float(v) for v in range(1, 16)] and flat.dtype == torch.float64
    back = StepSums.from_flat(flat, 2, (2, 3))
    for name in ("loss_G", "n_G", "samples_G", "tokens_G"):
        assert getattr(back, name).tolist() == getattr(sums, name).tolist()
    assert float(back.router) == 9.0
    assert back.load_LE.tolist() == [[10.0, 11.0, 12.0], [13.0, 14.0, 15.0]]
    assert StepSums.from_flat(StepSums.zeros(3, torch.device("cpu")).flat(), 3, None) \
        .load_LE is None


def test_a_step_record_takes_the_batchs_host_facts():
    # sample ids are (source, shard, key, epoch): b's sorts after a's
    bad = [SimpleNamespace(uid=("b", 0, "k7"), epoch=0),
           SimpleNamespace(uid=("a", 1, "k2"), epoch=1)]
    batch = SimpleNamespace(
        data_wait_s=0.25, micro_batches=[1, 2, 3], skipped=["x", "y"],
        replaced=[(bad[0], None), (bad[1], None)], io={"store_bytes": 10},
        metadata={"predicted_cost": 4.5, "imbalance": 1.2, "step_max_cost": 9.0,
                  "baseline_step_cost": 11.0, "baseline": "greedy"})
    record = step_record(3, batch, lr=0.1, grad_norm=torch.tensor(1.0), counts=None,
                         sums=None, row=None, wall_s=1.0, compute_s=0.5)
    assert (record.step, record.data_wait_s, record.predicted_cost) == (3, 0.25, 4.5)
    assert record.plan == {"imbalance_predicted": 1.2, "predicted_step_cost": 9.0,
                           "baseline_predicted_step_cost": 11.0, "baseline_policy": "greedy"}
    assert (record.micro_batches, record.skipped) == (3, 2)
    assert record.replaced == [("a", 1, "k2", 1), ("b", 0, "k7", 0)]
    assert record.io == {"store_bytes": 10} and record.io is not batch.io


def _env(world=2, writer=True):
    return SimpleNamespace(
        cfg=SimpleNamespace(watchdog=SimpleNamespace(straggler_factor=1.5, straggler_steps=2)),
        writer=writer, device=torch.device("cpu"), world=world, sum_group=None, group=None)


def _row(record, sums, counts, times, skipped):
    return {"step": record.step, "sums": sums.tolist(), "counts": counts.tolist(),
            "skipped": skipped, **times}


def _record(step, sums, *, cost, compute, wall, wait, skipped=0, replaced=(), lengths=None,
            io=None, host_syncs=None, micro_batches=2, update_skipped=None, phases=None):
    return StepRecord(step=step, lr=0.1, grad_norm=torch.tensor(2.0 * step), counts=torch.tensor(
        [float(step)]), sums=torch.tensor(sums, dtype=torch.float64), row=_row, wall_s=wall,
        compute_s=compute, data_wait_s=wait, predicted_cost=cost, plan={"baseline_policy": "x"},
        micro_batches=micro_batches, skipped=skipped, replaced=list(replaced), lengths=lengths,
        io=io or {}, host_syncs=host_syncs, update_skipped=update_skipped, phases=phases or {})


def _peer(monkeypatch, peer_sums, peer_host, peer_objects):
    """``flush_metrics`` as two data ranks' collectives return it on rank 0."""
    def flush_metrics(sums, host, objects, world, sum_group, group):
        assert world == 2
        return (sums + torch.tensor(peer_sums, dtype=torch.float64),
                [host, torch.tensor(peer_host, dtype=torch.float64)], [objects, peer_objects])
    monkeypatch.setattr(collectives, "flush_metrics", flush_metrics)


def _state():
    return RunState(clock=ComputeClock("cpu"), audit=None)


def test_two_steps_rows_sum_both_ranks_and_time_the_step_by_its_slowest_rank(monkeypatch):
    # steps 1 and 2, two sums each; the peer (rank 1) adds 10 to each sum
    mine = [_record(1, [1.0, 2.0], cost=2.0, compute=1.0, wall=1.5, wait=0.5),
            _record(2, [3.0, 4.0], cost=2.0, compute=2.0, wall=2.5, wait=0.0)]
    # the peer's host rows: [predicted cost, compute s, wall s, data wait s, skipped]
    _peer(monkeypatch, [10.0] * 4, [[2.0, 3.0, 3.5, 0.25, 0], [2.0, 1.0, 1.0, 1.5, 0]],
          [(None, [], {}, {}), (None, [], {}, {})])
    state = _state()
    rows = records.flush(_env(), state, mine)
    first, second = rows
    assert first["sums"] == [11.0, 12.0] and second["sums"] == [13.0, 14.0]
    assert (first["counts"], second["counts"]) == ([1.0], [2.0])
    assert (first["grad_norm"], second["grad_norm"]) == (2.0, 4.0)
    # step 1: ranks computed 1 s and 3 s; wall + wait: 2.0 and 3.75 -> the step 3.75 s,
    # the wait fraction 0.5 / 3.75; imbalance 3 / mean(1, 3) = 1.5; no cost fit yet
    assert first["rank_compute_s"] == [1.0, 3.0] and first["rank_wall_s"] == [1.5, 3.5]
    assert first["step_s"] == 3.75 and first["data_wait_frac"] == pytest.approx(0.5 / 3.75)
    assert first["imbalance_measured"] == 1.5 and first["measured_step_s"] == 3.0
    assert first["predicted_step_s"] is None and first["rank_slowdown"] is None
    assert first["rank_predicted_cost"] == [2.0, 2.0] and first["baseline_policy"] == "x"
    # step 2 is judged by the fit of step 1: k = (2*1 + 2*3) / (2^2 + 2^2) = 1 s per cost
    assert second["predicted_step_s"] == 2.0 and second["rank_slowdown"] == [1.0, 0.5]
    assert second["step_s"] == 2.5 and second["data_wait_frac"] == pytest.approx(1.5 / 2.5)
    assert state.fit.k == pytest.approx((2 * 1 + 2 * 3 + 2 * 2 + 2 * 1) / 16)
    assert "update_skipped" not in first and "data_io" not in first


def test_each_phase_is_listed_by_rank_and_left_out_when_a_rank_did_not_time_it(monkeypatch):
    mine = [_record(1, [0.0], cost=1.0, compute=1.0, wall=1.0, wait=0.0,
                    phases={"encode": (0.25, 0.2), "backbone": (0.75, 0.7)})]
    _peer(monkeypatch, [0.0], [[1.0, 1.0, 1.0, 0.0, 0]],
          [(None, [], {}, {"encode": (0.5, 0.1), "backbone": (0.5, 0.4)})])
    row = records.flush(_env(), _state(), mine)[0]
    assert row["rank_phase_wall_s"] == {"encode": [0.25, 0.5], "backbone": [0.75, 0.5]}
    assert row["rank_phase_compute_s"] == {"encode": [0.2, 0.1], "backbone": [0.7, 0.4]}
    _peer(monkeypatch, [0.0], [[1.0, 1.0, 1.0, 0.0, 0]], [(None, [], {}, {})])  # on CUDA
    row = records.flush(_env(), _state(), mine)[0]
    assert "rank_phase_wall_s" not in row and "rank_phase_compute_s" not in row


def test_a_sample_both_ranks_skipped_is_counted_once(monkeypatch):
    mine = [_record(1, [0.0], cost=1.0, compute=1.0, wall=1.0, wait=0.0, skipped=2,
                    replaced=[("a", 1), ("b", 2)])]
    # the peer decoded the media of a/1 and skipped it too, and one of its own, c/3
    _peer(monkeypatch, [0.0], [[1.0, 1.0, 1.0, 0.0, 2]],
          [([None], [("a", 1), ("c", 3)], {}, {})])
    rows = records.flush(_env(), _state(), mine)
    assert rows[0]["skipped"] == 3  # a/1, b/2, c/3: not the 4 the ranks reported


def test_one_rank_reports_its_skips_as_counted(monkeypatch):
    def flush_metrics(sums, host, objects, world, sum_group, group):
        return sums, [host], [objects]
    monkeypatch.setattr(collectives, "flush_metrics", flush_metrics)
    mine = [_record(1, [0.0], cost=1.0, compute=1.0, wall=1.0, wait=0.0, skipped=2,
                    replaced=[("a", 1), ("a", 1)])]
    assert records.flush(_env(world=1), _state(), mine)[0]["skipped"] == 2


def test_rank_0_keeps_each_ranks_lengths_for_the_cost_refit_and_other_ranks_do_not(
        monkeypatch):
    for writer, kept in ((True, [[5, 6], [7]]), (False, [])):
        _peer(monkeypatch, [0.0], [[1.0, 4.0, 4.0, 0.0, 0]], [([7], [], {}, {})])
        state = _state()
        mine = [_record(1, [0.0], cost=1.0, compute=2.0, wall=2.0, wait=0.0, lengths=[5, 6])]
        records.flush(_env(writer=writer), state, mine)
        assert state.refit.lengths == kept
        assert state.refit.seconds == ([2.0, 4.0] if writer else [])


def test_the_rows_carry_the_guards_verdict_and_the_host_syncs_per_micro_batch(monkeypatch):
    _peer(monkeypatch, [0.0], [[1.0, 1.0, 1.0, 0.0, 0]], [(None, [], {}, {})])
    mine = [_record(1, [0.0], cost=1.0, compute=1.0, wall=1.0, wait=0.0,
                    host_syncs={"item": 3, "nonzero": 3}, micro_batches=4,
                    update_skipped="non-finite gradient norm")]
    row = records.flush(_env(), _state(), mine)[0]
    assert row["update_skipped"] == "non-finite gradient norm"
    assert row["host_syncs"] == {"item": 3, "nonzero": 3}
    assert row["host_syncs_per_micro_batch"] == 1.5


def test_object_store_reads_add_up_over_ranks_with_hit_rate_and_bytes_per_sample():
    io = records._data_io([{"cache_hits": 3, "cache_misses": 1, "store_bytes": 400},
                           {"cache_hits": 1, "cache_misses": 3, "store_bytes": 600}], 10)
    assert io == {"cache_hits": 4, "cache_misses": 4, "store_bytes": 1000,
                  "cache_hit_rate": 0.5, "store_bytes_per_sample": 100.0}
    # no block read through the cache: no rate; no samples counted: no per-sample bytes
    assert records._data_io([{"store_bytes": 8}, {}], None) == {
        "store_bytes": 8, "cache_hit_rate": None}
    assert records._data_io([{}, {"store_bytes": 0}], 5) == {}  # every source local


def test_a_flush_of_no_steps_makes_no_rows_and_calls_no_collective(monkeypatch):
    def refuse(*args):
        raise AssertionError("no collective for an empty interval")
    monkeypatch.setattr(collectives, "flush_metrics", refuse)
    assert records.flush(_env(), _state(), []) == []


def test_a_batch_without_a_prediction_has_no_predicted_cost():
    # a plan without costs (its metadata names none): 0, which the stragglers and the
    # cost fit read as "nothing predicted" and skip
    batch = SimpleNamespace(data_wait_s=0.0, micro_batches=[], skipped=[], replaced=[],
                            metadata={})
    record = step_record(1, batch, lr=0.1, grad_norm=torch.tensor(1.0), counts=None,
                         sums=None, row=None, wall_s=1.0, compute_s=0.5)
    assert record.predicted_cost == 0.0
    assert record.plan == {"imbalance_predicted": None, "predicted_step_cost": None,
                           "baseline_predicted_step_cost": None, "baseline_policy": None}


def test_straggler_lines_are_printed_by_the_writing_rank_only(monkeypatch, capsys):
    # rank 1 computes 3x its prediction for two steps (straggler_steps=2, factor 1.5)
    for writer in (True, False):
        state = _state()
        for step in (1, 2, 3):
            _peer(monkeypatch, [0.0], [[1.0, 1.0 if step == 1 else 3.0, 1.0, 0.0, 0]],
                  [(None, [], {}, {})])
            mine = [_record(step, [0.0], cost=1.0, compute=1.0, wall=1.0, wait=0.0)]
            records.flush(_env(writer=writer), state, mine)
        out = capsys.readouterr().out
        if writer:
            assert "straggler: data rank 1" in out and "(step 3)" in out
        else:
            assert out == ""


def test_a_step_shorter_than_a_second_gets_its_own_wait_fraction(monkeypatch):
    # 0.2 s computing after 0.05 s waiting, on both ranks: the step is 0.25 s, a fifth waiting
    _peer(monkeypatch, [0.0], [[1.0, 0.2, 0.2, 0.05, 0]], [(None, [], {}, {})])
    mine = [_record(1, [0.0], cost=1.0, compute=0.2, wall=0.2, wait=0.05)]
    row = records.flush(_env(), _state(), mine)[0]
    assert row["step_s"] == pytest.approx(0.25)
    assert row["data_wait_frac"] == pytest.approx(0.2)


def test_a_step_no_rank_computed_in_is_balanced_not_a_division_by_zero(monkeypatch):
    _peer(monkeypatch, [0.0], [[0.0, 0.0, 0.1, 0.0, 0]], [(None, [], {}, {})])
    mine = [_record(1, [0.0], cost=0.0, compute=0.0, wall=0.1, wait=0.0,
                    host_syncs={"item": 2}, micro_batches=0)]
    row = records.flush(_env(), _state(), mine)[0]
    assert row["imbalance_measured"] == 0.0
    assert row["host_syncs_per_micro_batch"] == 2.0  # no micro-batch: the step's own count


def test_reads_that_name_only_misses_or_only_hits_count_the_other_as_none():
    # misses only: nothing hit; hits only: no byte fetched from the store
    assert records._data_io([{"cache_misses": 2, "store_bytes": 8}], 4) == {
        "cache_misses": 2, "store_bytes": 8, "cache_hit_rate": 0.0,
        "store_bytes_per_sample": 2.0}
    assert records._data_io([{"cache_hits": 2}], 4) == {
        "cache_hits": 2, "cache_hit_rate": 1.0, "store_bytes_per_sample": 0.0}
