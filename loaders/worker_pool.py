"""The loader's own worker pool: forked processes that run one function over work items and
hand the results back in the order the items were submitted.

Why not ``torch.utils.data.DataLoader``: driving it item by item from a plan (prefetch as far
as the plane has planned, a dead worker replaced without losing or repeating an item) needed
its private fields, which tie the project to one torch version. What it did that matters is
here, in the standard library's terms:

- **fork**, with this process's objects kept out of the workers' garbage collector
  (``gc.freeze``): a worker that collects garbage it inherited (a closed plane client, a
  stopped embedded plane: Arrow Flight / gRPC objects whose threads did not survive the fork)
  can crash with SIGSEGV or hang on a lock; frozen objects are never collected. PyAV's
  per-thread scalers are kept out of the child's thread cleanup (``loaders.av_fork``).
  Anything the workers share by memory (the transfer ring, ``loaders.transfer.ShmRing``) is
  made before.
- **two pipes per worker** (items in, results out) rather than queues shared by all: a worker
  killed in the middle of a message damages only its own pipe, every message it completed
  before is still read from it, and nothing another worker sent is lost with it.
- **prefetch**: each item goes to the worker with the fewest in hand; at most ``items_ahead``
  items per worker are submitted and not yet returned (torch's ``prefetch_factor`` bound),
  so results received out of order wait in a bounded buffer.
- **liveness** by ``multiprocessing.connection.wait`` on every worker's result pipe and its
  process sentinel: a death is seen the moment the process is gone, not after a timeout.
  The results it completed are read, ``on_death`` is told (it may refuse by raising), a new
  process takes its index and is sent the items the dead one held, in order. Each item's
  result is kept once, by its sequence number, so nothing is lost or returned twice.
- **errors**: an exception raised by the function comes back in the item's place, and
  :meth:`WorkerPool.get` raises it with its message, the worker's traceback as a note.
- **shutdown**: closing the item pipes tells idle workers to exit; one that is still busy
  gets ``_CLOSE_GRACE_S`` to finish its item (torch's shutdown waits as long), then SIGTERM,
  then SIGKILL, and decodes none of the items it had read ahead. The workers also exit on
  their own if this process dies (their item pipe reaches end of file, or failing that, their
  parent pid changes). :meth:`WorkerPool.interrupt` ends a :meth:`WorkerPool.get` waiting on
  another thread (the loader's close wakes its assembly thread so).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Callable

import torch

from omniscale.loaders.av_fork import keep_scalers_across_fork
from omniscale.loaders.transfer import ShmRing

_CLOSE_GRACE_S = 5.0  # a busy worker's time to finish its item on close (as torch waits)
_REAP_S = 5.0  # a process whose pipe broke exits within this (it closes fds, then is reaped)
_PARENT_CHECK_S = 5.0  # how often an idle worker checks that its parent still lives

# Forks of every pool of this process, one at a time: a pipe's worker end must be closed here
# before anything else forks, or that other child would hold it open and this worker's death
# would not reach end of file.
_FORK_LOCK = threading.Lock()
# This process's ends of every pool's pipes: a forked worker closes its inherited copies, so
# only this process holds them (else a worker would not see end of file when this one dies).
_PARENT_ENDS: set[Connection] = set()
_WORKER_INDEX: int | None = None  # in a worker process: its index in its pool
_CLOSING = threading.Event()  # in a worker process: its pool closed the item pipe


def worker_index() -> int | None:
    """In a pool's worker process, its index (0 .. workers - 1, kept by a replacement);
    None in any other process."""
    return _WORKER_INDEX


@dataclass(frozen=True)
class WorkerDeath:
    """A worker process that died: its ``index`` in the pool, ``pid``, ``exitcode``
    (negative: the signal that killed it) and the ``items`` it held, sent and not returned,
    in submission order (they go to its replacement)."""

    index: int
    pid: int
    exitcode: int | None
    items: list

    @property
    def reason(self) -> str:
        if self.exitcode is not None and self.exitcode < 0:
            return f"killed by signal {-self.exitcode}"
        return f"exited with code {self.exitcode}"


class _Worker:
    """This process's handle on one worker process: its pipes and the items it holds."""

    def __init__(self, index: int, process, tasks: Connection, results: Connection) -> None:
        self.index, self.process = index, process
        self.tasks, self.results = tasks, results  # this process's ends: send, receive
        self.held: dict[int, object] = {}  # sequence number -> item, sent and not returned

    def close_pipes(self) -> None:
        with _FORK_LOCK:  # so that no fork in between inherits an end it does not close
            for conn in (self.tasks, self.results):
                _PARENT_ENDS.discard(conn)
                conn.close()


class WorkerPool:
    """``workers`` forked processes, each running ``work(item)`` on the items sent to it.

    :meth:`submit` an item when :meth:`has_room`; :meth:`get` returns results in submission
    order. ``ring`` (optional, owned by the pool from here on): the shared-memory slots the
    workers hand results over in; a dead worker's slots are reset before its replacement
    forks, and the ring is unmapped on :meth:`close`. ``on_death(WorkerDeath)`` is called
    on the thread in :meth:`get` before a dead worker is replaced; if it raises, the pool
    replaces nothing more and every later :meth:`get` raises that error.
    """

    def __init__(self, work: Callable[[object], object], workers: int, items_ahead: int = 2,
                 *, ring: ShmRing | None = None,
                 on_death: Callable[[WorkerDeath], None] | None = None,
                 name: str = "omniscale-worker") -> None:
        if workers < 1 or items_ahead < 1:
            raise ValueError(f"WorkerPool: workers and items_ahead must be >= 1, got "
                             f"{workers}, {items_ahead}")
        self._work, self._ring, self.on_death, self.name = work, ring, on_death, name
        self.items_ahead = int(items_ahead)
        self.restarts = 0  # dead workers replaced
        self._workers: list[_Worker] = []
        self._returned: dict[int, tuple[bool, object]] = {}  # received, not yet handed out
        self._submitted = self._handed_out = 0  # sequence numbers: next to give, next to return
        self._failed: BaseException | None = None  # what on_death raised
        self._closed = False
        # interrupt()'s wake-up: a byte on this pipe ends a get() waiting on another thread
        self._wake_out, self._wake_in = multiprocessing.Pipe(duplex=False)
        self._wake_lock = threading.Lock()  # interrupt() never writes to a closed (reused) fd
        with _FORK_LOCK:
            _PARENT_ENDS.update((self._wake_out, self._wake_in))
        try:
            for index in range(workers):
                self._workers.append(self._fork(index))
        except BaseException:
            self.close()
            raise

    # -- the caller's side ----------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        """Items submitted and not yet returned by :meth:`get`."""
        return self._submitted - self._handed_out

    def has_room(self) -> bool:
        """Whether :meth:`submit` may send another item now (the prefetch bound)."""
        return self.outstanding < self.items_ahead * len(self._workers)

    def pids(self) -> list[int]:
        """The worker processes' pids, by index (a replaced worker's successor's)."""
        return [w.process.pid for w in self._workers]

    def submit(self, item) -> None:
        """Send ``item`` to the worker with the fewest items in hand."""
        if self._closed:
            raise RuntimeError("WorkerPool.submit: the pool is closed")
        message = ForkingPickler.dumps((self._submitted, item))  # an item that cannot cross
        worker = min(self._workers, key=lambda w: len(w.held))   # is refused before it counts
        worker.held[self._submitted] = item
        self._submitted += 1
        _send(worker, message)

    def interrupt(self) -> None:
        """End a :meth:`get` waiting on another thread now, and every later one at once (it
        returns None): the owner is closing and wants no more results. Thread-safe."""
        with self._wake_lock:
            if not self._wake_in.closed:  # else closed: nothing waits any more
                self._wake_in.send_bytes(b"!")

    def get(self, timeout: float | None = None):
        """The result of the oldest item not yet returned; None if it did not arrive within
        ``timeout`` seconds, or after :meth:`interrupt`. An item whose work raised raises
        that error here."""
        if self._failed is not None:
            raise self._failed
        if not self.outstanding:
            raise RuntimeError("WorkerPool.get: no item submitted and not yet returned")
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._handed_out not in self._returned:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            watched = {}
            for w in self._workers:
                watched[w.results] = watched[w.process.sentinel] = w
            ready = wait([*watched, self._wake_out], left)
            if self._wake_out in ready:  # interrupted (the byte stays: later gets end too)
                return None
            for handle in ready:
                w = watched[handle]
                if w is not self._workers[w.index]:
                    continue  # replaced a moment ago, while handling another handle
                if handle is w.process.sentinel:
                    self._replace(w)
                elif (broken := self._receive(w)) is not None:
                    self._replace_dead(w, broken)
            if not ready:
                # A death seen by the process table alone: a pipe held open by a foreign
                # fork hides it from wait(), is_alive() reaps it.
                for w in [w for w in self._workers if not w.process.is_alive()]:
                    self._replace(w)
                if deadline is not None and time.monotonic() >= deadline:
                    return None
        ok, value = self._returned.pop(self._handed_out)
        self._handed_out += 1
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Stop every worker (none is left running), then unmap the ring. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with _FORK_LOCK:  # so that no fork in between inherits an end it does not close
            for w in self._workers:
                _PARENT_ENDS.discard(w.tasks)
                w.tasks.close()  # end of file: a worker between items exits now
        processes = [w.process for w in self._workers]
        _wait_exit(processes, _CLOSE_GRACE_S)
        for signal_them in ("terminate", "kill"):
            alive = [p for p in processes if p.exitcode is None]
            for p in alive:
                getattr(p, signal_them)()
            _wait_exit(alive, _REAP_S)
        for p in processes:
            p.join()
        for w in self._workers:
            w.close_pipes()
        with _FORK_LOCK, self._wake_lock:
            for conn in (self._wake_out, self._wake_in):
                _PARENT_ENDS.discard(conn)
                conn.close()
        self._returned.clear()
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- workers come and go --------------------------------------------------------------
    def _fork(self, index: int) -> _Worker:
        ctx = multiprocessing.get_context("fork")
        with _FORK_LOCK:
            task_out, task_in = ctx.Pipe(duplex=False)  # (receiving end, sending end)
            result_out, result_in = ctx.Pipe(duplex=False)
            _PARENT_ENDS.update((task_in, result_out))
            process = ctx.Process(target=_serve, name=f"{self.name}-{index}", daemon=True,
                                  args=(index, self._work, task_out, result_in, os.getpid()))
            keep_scalers_across_fork()  # else PyAV frees another thread's scaler in the child
            gc.collect()  # the garbage is freed here, where its threads still run
            ours = gc.get_freeze_count() == 0  # leave anyone else's freeze as it is
            gc.freeze()
            try:
                process.start()
            except BaseException:
                for conn in (task_in, result_out):
                    _PARENT_ENDS.discard(conn)
                    conn.close()
                raise
            finally:
                if ours:
                    gc.unfreeze()
                task_out.close()  # the worker's ends live in the worker alone
                result_in.close()
        return _Worker(index, process, task_in, result_out)

    def _receive(self, w: _Worker) -> BaseException | None:
        """One message from ``w``'s result pipe into ``_returned``; the error instead when
        the pipe broke (its end, a message cut short, the item's buffer no longer
        reachable: the worker is gone or going, and the item counts as not returned)."""
        try:
            seq, ok, value = ForkingPickler.loads(w.results.recv_bytes())
        except (EOFError, OSError) as e:
            return e
        w.held.pop(seq)
        if not ok:
            value = _raised(value, w)
        self._returned[seq] = (ok, value)
        return None

    def _replace_dead(self, w: _Worker, broken: BaseException) -> None:
        """``w``'s pipe broke with ``broken``: it died in the middle of a hand-over (a
        process killed closes its pipes just before it can be reaped). Anything else (a
        live worker whose message cannot be read) is raised."""
        if w.process.sentinel not in wait([w.process.sentinel], _REAP_S):
            raise broken
        self._replace(w)

    def _replace(self, w: _Worker) -> None:
        """``w`` died: read what it completed, tell ``on_death``, then fork its successor
        and send it the items ``w`` held, in order."""
        while w.results.poll() and self._receive(w) is None:  # end of file polls as ready
            pass
        w.process.join(_REAP_S)
        if w.process.exitcode is None:  # its pipe broke, yet it lives on: useless now
            w.process.kill()
            w.process.join()
        death = WorkerDeath(w.index, w.process.pid, w.process.exitcode, list(w.held.values()))
        w.close_pipes()
        if self.on_death is not None:
            try:
                self.on_death(death)
            except BaseException as e:
                self._failed = e
                raise
        if self._ring is not None:  # every message of w's is read: its slots are free
            self._ring.reset(w.index)
        successor = self._fork(w.index)
        self._workers[w.index] = successor
        self.restarts += 1
        for seq, item in w.held.items():
            successor.held[seq] = item
            _send(successor, ForkingPickler.dumps((seq, item)))


def _send(w: _Worker, message) -> None:
    """``message`` down ``w``'s item pipe; a worker already dead is left for :meth:`get`
    to notice and replace (it re-sends what the dead one held, this item included)."""
    try:
        w.tasks.send_bytes(message)
    except (BrokenPipeError, ConnectionResetError):
        pass


def _wait_exit(processes: list, timeout: float) -> None:
    """Until every one of ``processes`` has exited, or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pending = {p.sentinel: p for p in processes if p.exitcode is None}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for sentinel in wait(list(pending), left):
            pending.pop(sentinel).join()


def _raised(failure: tuple, w: _Worker) -> BaseException:
    """A worker's exception, rebuilt here, its traceback there as a note."""
    error, trace = failure
    error.add_note(f"raised in {w.process.name} (pid {w.process.pid}):\n{trace}")
    return error


def _portable(error: Exception) -> tuple[BaseException, str]:
    """``error`` and its traceback as a worker sends them: the exception itself when it
    pickles, else a RuntimeError naming its type and message."""
    trace = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 -- any exception at all must reach the caller
        error = RuntimeError(f"{type(error).__name__}: {error}")
    return error, trace


# -- in the worker process --------------------------------------------------------------------
def _serve(index: int, work: Callable, tasks: Connection, results: Connection,
           parent: int) -> None:
    global _WORKER_INDEX
    _WORKER_INDEX = index
    for conn in _PARENT_ENDS:  # the pool's ends (this worker's own included) stay there
        conn.close()
    _PARENT_ENDS.clear()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    torch.set_num_threads(1)  # as torch's workers: N workers x all cores would oversubscribe
    # Items are read off the pipe as they come, on a thread of their own: a pipe holds 64 KiB,
    # a few micro-batches' refs, and a full one would block the pool's submit -- the loader's
    # assembly thread -- until this worker finished its current item.
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_items, args=(tasks, parent, inbox), daemon=True,
                     name="omniscale-worker-inbox").start()
    while True:
        got = inbox.get()
        # The pool closed the pipe, or this worker is orphaned: the items still queued are
        # nobody's now (the pool reads no result after close), so they are not decoded -- a
        # worker used to decode its whole read-ahead first, seconds of video on every close.
        if got is None or _CLOSING.is_set():
            return
        seq, item = got
        try:
            message = ForkingPickler.dumps((seq, True, work(item)))
        except Exception as e:  # noqa: BLE001 -- handed back in the item's place
            message = ForkingPickler.dumps((seq, False, _portable(e)))
        try:
            results.send_bytes(message)
        except OSError:  # the pool is gone
            return


def _read_items(tasks: Connection, parent: int, inbox: "queue.SimpleQueue") -> None:
    """A worker's reader: every item from the pool's pipe into ``inbox``, then ``_CLOSING``
    set and None once the pipe is closed or the trainer is gone."""
    while True:
        if not wait([tasks], _PARENT_CHECK_S):
            if os.getppid() != parent:  # orphaned: the item pipe is held open elsewhere
                break
            continue
        try:
            inbox.put(tasks.recv())
        except (EOFError, OSError):  # closed by the pool, or its process died
            break
    _CLOSING.set()
    inbox.put(None)
