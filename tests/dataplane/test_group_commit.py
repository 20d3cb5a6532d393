"""Group commit: rank commits that arrive together share fsyncs of the plane's log, and each
is durable before it is acknowledged. The disk is made slow (each fsync takes 20 ms more) so
that commits overlap; that stands in for a slow disk, it does not order anything."""

from __future__ import annotations

import os
import threading
import time

from dataplane import journal as journal_module
from dataplane.journal import Journal
from dataplane.plan_table import fingerprint
from dataplane.plane import DataPlane, PlaneConfig

RANKS = 16
CONFIG = PlaneConfig(dp=RANKS, micro_batch_tokens=8192, window=4,
                     global_batch_tokens=RANKS * 4096, sp_max=1, snapshot_every=3)


def slow_disk(monkeypatch, seconds=0.02):
    real = os.fsync

    def fsync(fd):
        time.sleep(seconds)
        real(fd)
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
    slow_disk(monkeypatch)
    journal = Journal(tmp_path)

    def write(i):
        offset = journal.append({"t": "rank", "i": i}, sync=False)
        journal.sync_to(offset)
        assert journal.synced >= offset  # durable before it returns

    on_threads(32, write)
    assert sorted(r["i"] for _, r in journal.records()) == list(range(32))
    assert 1 <= journal.fsyncs < 32
    assert journal.synced == journal.written == journal.size()


def test_a_steps_rank_commits_share_fsyncs_and_survive_a_restart(demo, tmp_path, monkeypatch):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    prints = [fingerprint(plane.get_plan(0, r)) for r in range(RANKS)]
    slow_disk(monkeypatch)
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
