"""Group commit: rank commits that arrive together share fsyncs of the plane's log, and each
is durable before it is acknowledged. The disk is held: no fsync completes until every writer
has written its record, so the commits are all pending together whatever the scheduler does
(events, not durations), and how many fsyncs they share is exact."""

from __future__ import annotations

import os
import threading

from omniscale.dataplane import journal as journal_module
from omniscale.dataplane.journal import Journal
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.plan import fingerprint

RANKS = 16
CONFIG = PlaneConfig(dp=RANKS, micro_batch_tokens=8192, window=4,
                     global_batch_tokens=RANKS * 4096, sp_max=1, snapshot_every=3)


def held_disk(monkeypatch, journal, writers):
    """Hold every fsync until `journal` has taken `writers` appends (a disk slow enough that
    they all arrive while the first fsync is in flight). The wait's timeout only catches a
    hang."""
    real_fsync, real_append = os.fsync, journal.append
    appended, count, lock = threading.Event(), [0], threading.Lock()

    def append(*args, **kwargs):
        offset = real_append(*args, **kwargs)
        with lock:
            count[0] += 1
            if count[0] >= writers:
                appended.set()
        return offset

    def fsync(fd):
        assert appended.wait(60), f"only {count[0]} of {writers} writers appended"
        real_fsync(fd)
    monkeypatch.setattr(journal, "append", append)
    monkeypatch.setattr(journal_module.os, "fsync", fsync)


def on_threads(n, work):
    """`work(i)` on n threads released together; their exceptions re-raised here."""
    start, errors = threading.Barrier(n), []

    def run(i):
        start.wait()
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_concurrent_writers_share_fsyncs_and_return_only_when_durable(tmp_path, monkeypatch):
    journal = Journal(tmp_path)
    held_disk(monkeypatch, journal, 32)

    def write(i):
        offset = journal.append({"t": "rank", "i": i}, sync=False)
        journal.sync_to(offset)
        assert journal.synced >= offset  # durable before it returns

    on_threads(32, write)
    assert sorted(r["i"] for _, r in journal.records()) == list(range(32))
    # the first fsync covers what was written when it started; all 32 were written before
    # it returned, so at most one more covers the rest and everyone else finds it done
    assert 1 <= journal.fsyncs <= 2
    assert journal.synced == journal.written == journal.size()


def test_a_steps_rank_commits_share_fsyncs_and_survive_a_restart(demo, tmp_path, monkeypatch):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    prints = [fingerprint(plane.get_plan(0, r)) for r in range(RANKS)]
    held_disk(monkeypatch, plane.journal, RANKS)  # 15 rank records + the step's
    before = plane.journal.fsyncs
    replies = [None] * RANKS

    def commit(r):
        replies[r] = plane.commit(0, r, prints[r])

    on_threads(RANKS, commit)
    assert sum(reply["committed"] for reply in replies) == 1  # the last rank's
    assert plane.next_step == 1
    assert plane.journal.fsyncs - before < RANKS  # 16 commits (15 rank records + the step's)
    again = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)  # killed after the replies
    assert again.next_step == 1
    assert again.commit(0, 3, prints[3])["repeated"]


def test_a_steps_rank_commits_hash_each_plan_once(demo, tmp_path, monkeypatch):
    """Every rank commit checks the step's plans; their fingerprints are computed once per
    plan, not once per commit (that was dp² hashes a step: 0.8 s at 256 ranks)."""
    from omniscale.dataplane import plan_table, plane_state

    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    calls = [0]
    one, sliced = plane_state.fingerprint, plan_table.slice_fingerprints

    def counted(table):
        calls[0] += 1
        return one(table)

    def counted_slices(table, starts, counts):
        calls[0] += len(counts)
        return sliced(table, starts, counts)
    monkeypatch.setattr(plane_state, "fingerprint", counted)
    monkeypatch.setattr(plan_table, "slice_fingerprints", counted_slices)
    prints = [fingerprint(plane.get_plan(0, r)) for r in range(RANKS)]
    for r in range(RANKS):
        plane.commit(0, r, prints[r])
    assert plane.next_step == 1
    window, _ = plane.state.window_of(0)
    assert calls[0] == len(window.tables) >= RANKS  # each plan built once, hashed once
