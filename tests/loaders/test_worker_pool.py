"""The loader's own worker pool: results in submission order, a worker killed mid-item
replaced with every item still returned exactly once, a worker's exception raised with its
message, and nothing left behind on close (no child process, no shared-memory segment)."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import psutil
import pytest
import torch

from omniscale.loaders import worker_pool
from omniscale.loaders.transfer import ShmRing, pack, unpack
from omniscale.loaders.worker_pool import WorkerPool, worker_index

FORK = multiprocessing.get_context("fork")  # events and counters the forked workers inherit


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()


def _collect(pool: WorkerPool, n: int) -> list:
    """``n`` results, each within 60 s."""
    out = []
    for _ in range(n):
        got = pool.get(timeout=60)
        assert got is not None, f"no result within 60 s after {len(out)}"
        out.append(got)
    return out


@pytest.mark.timeout(60)
def test_results_come_back_in_submission_order():
    """Item 0 is held back until every other item is done (by the other worker), so its
    result arrives last and the pool must reorder."""
    release, rest_done = FORK.Event(), FORK.Event()
    n = 8

    def work(i):
        if i == 0:
            assert release.wait(30)
        if i == n - 1:
            rest_done.set()
        return i * i, worker_index(), os.getpid()

    with WorkerPool(work, workers=2, items_ahead=4) as pool:
        for i in range(n):  # least loaded first: worker 0 takes 0, 2, 4, 6; worker 1 the odd
            assert pool.has_room()
            pool.submit(i)
        assert not pool.has_room()  # 2 workers x 4 items ahead
        assert rest_done.wait(30)
        assert pool.get(timeout=0.2) is None  # item 0 is still being worked on
        release.set()
        got = _collect(pool, n)
    assert [g[0] for g in got] == [i * i for i in range(n)]
    assert {g[1] for g in got} == {0, 1} and len({g[2] for g in got}) == 2


@pytest.mark.timeout(90)
def test_a_worker_killed_mid_item_is_replaced_and_every_item_arrives_once():
    """The worker holding item 3 is sent SIGKILL while it works on it; its successor (same
    index, new pid) decodes again what it held. Results cross in the ring, as the loader's
    do, so the dead worker's slots must be reset for the successor."""
    n, victim_item = 12, 3
    started, attempts, victim = FORK.Event(), FORK.Value("i", 0), FORK.Value("i", 0)
    ring = ShmRing(workers=2, slots=2, slot_bytes=1 << 16)

    def work(i):
        if i == victim_item:
            with attempts.get_lock():
                attempts.value += 1
                first = attempts.value == 1
            if first:
                victim.value = os.getpid()
                started.set()
                FORK.Event().wait()  # killed here
        return pack({"i": i, "x": torch.arange(64) + i}, ring, worker_index())

    deaths = []
    with WorkerPool(work, workers=2, items_ahead=4, ring=ring, on_death=deaths.append) as pool:
        before = pool.pids()
        for i in range(8):
            pool.submit(i)
        assert started.wait(30)
        os.kill(victim.value, signal.SIGKILL)
        got = _collect(pool, 4)
        for i in range(8, n):
            pool.submit(i)
        got += _collect(pool, n - 4)
        after = pool.pids()
    items = [unpack(g) for g in got]
    assert [it["i"] for it in items] == list(range(n))  # each once, in order
    assert all(torch.equal(it["x"], torch.arange(64) + it["i"]) for it in items)
    assert pool.restarts == 1 and attempts.value == 2
    [death] = deaths
    assert death.pid == victim.value and death.reason == "killed by signal 9"
    assert victim_item in death.items
    assert victim.value in before and victim.value not in after and len(after) == 2


@pytest.mark.timeout(60)
def test_on_death_may_refuse_the_replacement():
    def work(i):
        os.kill(os.getpid(), signal.SIGKILL)

    def refuse(death):
        raise RuntimeError(f"worker {death.pid} died ({death.reason}); giving up")

    with WorkerPool(work, workers=1, on_death=refuse) as pool:
        pool.submit(0)
        for _ in range(2):  # and it stays refused
            with pytest.raises(RuntimeError, match=r"died \(killed by signal 9\); giving up"):
                pool.get(timeout=30)
        assert pool.restarts == 0


class _Unpicklable(Exception):
    def __init__(self, message, handle):
        super().__init__(message)
        self.handle = handle

    def __reduce__(self):
        raise TypeError("not across processes")


@pytest.mark.timeout(60)
def test_a_workers_exception_is_raised_with_its_message_and_the_pool_goes_on():
    def work(i):
        if i == 1:
            raise ValueError(f"item {i} is bad")
        if i == 2:
            raise _Unpicklable(f"item {i} is worse", handle=lambda: None)
        return i

    with WorkerPool(work, workers=2) as pool:
        for i in range(4):
            pool.submit(i)
        assert pool.get(timeout=30) == 0
        with pytest.raises(ValueError) as e:
            pool.get(timeout=30)
        assert str(e.value) == "item 1 is bad"  # the message as raised, the rest in a note
        note = "\n".join(e.value.__notes__)
        assert "raised in omniscale-worker-" in note and "in work" in note  # its traceback
        with pytest.raises(RuntimeError, match=r"_Unpicklable: item 2 is worse"):
            pool.get(timeout=30)
        assert pool.get(timeout=30) == 3
        assert pool.restarts == 0


@pytest.mark.timeout(60)
def test_close_leaves_no_process_and_no_shared_memory(monkeypatch):
    """Closed with one worker idle and one stuck in its item for good: the idle one exits at
    once, the stuck one is terminated after the grace period; the segments the workers made
    (results too large for a ring slot) are gone with them."""
    monkeypatch.setattr(worker_pool, "_CLOSE_GRACE_S", 0.5)
    shm_before = _dev_shm()
    stuck = FORK.Event()
    ring = ShmRing(workers=2, slots=1, slot_bytes=1 << 10)

    def work(i):
        if i == "stuck":
            stuck.set()
            FORK.Event().wait()
        return pack({"x": torch.zeros(4096, dtype=torch.uint8) + i}, ring, worker_index())

    pool = WorkerPool(work, workers=2, ring=ring)
    pids = pool.pids()
    for i in range(4):
        pool.submit(i)
    assert [int(unpack(r)["x"][0]) for r in _collect(pool, 4)] == [0, 1, 2, 3]
    pool.submit("stuck")
    assert stuck.wait(30)
    pool.close()
    pool.close()  # idempotent
    assert not set(pids) & {p.pid for p in multiprocessing.active_children()}
    for pid in pids:  # reaped, not left a zombie (a pid that exists again is someone else's)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).ppid() != os.getpid()
    ours = {str(p) for p in (*pids, os.getpid())}
    assert not {n for n in _dev_shm() - shm_before if any(p in n for p in ours)}
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(5)


@pytest.mark.timeout(60)
def test_close_skips_the_items_a_worker_read_ahead(tmp_path):
    """A worker holds items read ahead when its pool closes: it finishes the one in hand and
    decodes none of the others (nobody reads their results; a read-ahead of video items took
    seconds on every loader's close). Item 0 returns only once the worker has seen the pipe
    close, so items 1-3 are queued in it by then."""
    started = FORK.Event()
    log = tmp_path / "worked"

    def work(i):
        with log.open("a") as f:
            f.write(f"{i}\n")
        if i == 0:
            started.set()
            assert worker_pool._CLOSING.wait(30)
        return i

    pool = WorkerPool(work, workers=1, items_ahead=4)
    for i in range(4):
        pool.submit(i)
    assert started.wait(30)
    pool.close()
    assert log.read_text().split() == ["0"]


@pytest.mark.timeout(60)
def test_interrupt_ends_a_get_waiting_on_another_thread():
    """A loader closing while its assembly thread waits for a result: interrupt() ends that
    wait at once (it polled a stop flag once a second), and every later get returns None."""
    import threading

    release = FORK.Event()

    def work(i):
        assert release.wait(30)
        return i

    pool = WorkerPool(work, workers=1)
    try:
        pool.submit(0)
        got = []
        waiter = threading.Thread(target=lambda: got.append(pool.get(timeout=None)))
        waiter.start()
        pool.interrupt()
        waiter.join(30)
        assert not waiter.is_alive() and got == [None]
        assert pool.get(timeout=None) is None
    finally:
        release.set()
        pool.close()
    pool.interrupt()  # after close: nothing to wake, no error


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="workers and items_ahead must be >= 1"):
        WorkerPool(abs, workers=0)
