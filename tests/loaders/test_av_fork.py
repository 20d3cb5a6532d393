"""PyAV's per-thread scaler across the loader's fork (``loaders.av_fork``): a worker pool forked
from one thread after another thread scaled a frame with PyAV starts and decodes (with PyAV
18.1.1 and no stand-in, the child froze inside ``os.fork``, freeing the other thread's
scaler); the stand-in keeps one scaler per thread, frees a dead thread's in the parent, and a
child starts without its parent's."""

from __future__ import annotations

import gc
import io
import multiprocessing
import threading
import weakref

import numpy as np
import pytest

from omniscale.geometry import MediaGeometry
from omniscale.loaders import av_fork
from omniscale.loaders.decode_video import _pyav_frames
from omniscale.loaders.worker_pool import WorkerPool
from tests.loaders.index_fixtures import video_bytes

G = MediaGeometry(patch_size=8, max_pixels=64 * 64, min_pixels=16 * 16,
                  video_max_pixels=64 * 64)


def _rgb_frames(data: bytes) -> np.ndarray:
    """Every frame through PyAV's own per-frame path (``to_ndarray(format=...)``: the scaler
    PyAV >= 18.1.1 keeps per thread)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _decode_both(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    return _rgb_frames(data), _pyav_frames(data, G, 32, 48)


@pytest.mark.timeout(120)
def test_a_pool_forked_from_another_thread_decodes_after_pyav_scaled_here():
    import av.video.frame as frame

    if hasattr(frame, "_thread_local"):  # PyAV's own, as before any pool forked (not ours)
        # Not monkeypatch: its copy of the one replaced would keep that one's scalers alive
        # here (made by earlier tests' threads), which is what the pool's swap ends.
        frame._thread_local = threading.local()
    clip = video_bytes(10, 5, 48, 32, textured=True)
    want = _decode_both(clip)  # this (main) thread now holds a PyAV scaler
    scaled, stop = threading.Event(), threading.Event()

    def scale_then_stay():  # a second thread holding its own, alive across the fork
        _rgb_frames(clip)
        scaled.set()
        stop.wait()

    holder = threading.Thread(target=scale_then_stay)
    holder.start()
    got: list = []

    def fork_and_decode():  # the loader forks from its assembly thread, not the main one
        with WorkerPool(_decode_both, workers=1) as pool:
            pool.submit(clip)
            got.append(pool.get(timeout=60))

    try:
        scaled.wait()
        forker = threading.Thread(target=fork_and_decode)
        forker.start()
        forker.join()
    finally:
        stop.set()
        holder.join()
    assert got and got[0] is not None, "the forked worker never answered"
    assert all(np.array_equal(a, b) for a, b in zip(got[0], want))


def test_pyav_reads_its_scaler_from_the_stand_in():
    """The private name the stand-in replaces is the one PyAV uses: after the swap, a frame's
    ``reformat`` stores this thread's scaler there and reuses it."""
    import av.video.frame as frame

    if not hasattr(frame, "_thread_local"):
        pytest.skip(f"PyAV {__import__('av').__version__} keeps no per-thread scaler")
    av_fork.keep_scalers_across_fork()
    stand_in = frame._thread_local
    assert isinstance(stand_in, av_fork.ScalerPerThread)
    av_fork.keep_scalers_across_fork()
    assert frame._thread_local is stand_in  # idempotent
    _rgb_frames(video_bytes(4, 5, 48, 32))
    scaler = stand_in.reformatter
    assert type(scaler).__name__ == "VideoReformatter"
    _rgb_frames(video_bytes(4, 5, 64, 32))
    assert stand_in.reformatter is scaler


class _Scaler:
    """Stands for a scaler: only whether it is alive matters here (a weak reference tells)."""


def test_one_value_per_thread_a_dead_threads_freed_and_a_child_starts_empty():
    per_thread = av_fork.ScalerPerThread()
    assert per_thread.reformatter is None
    mine = _Scaler()
    per_thread.reformatter = mine
    theirs: list[weakref.ref] = []
    seen: list = []

    def set_one():
        seen.append(per_thread.reformatter)  # not the main thread's, nor an ended one's
        scaler = _Scaler()
        per_thread.reformatter = scaler
        theirs.append(weakref.ref(scaler))

    for _ in range(2):
        thread = threading.Thread(target=set_one)
        thread.start()
        thread.join()
        gc.collect()
    # the first thread's scaler was freed when the second set one (its thread had ended)
    assert seen == [None, None] and theirs[0]() is None and theirs[1]() is not None
    assert per_thread.reformatter is mine
    with pytest.raises(AttributeError):
        per_thread.other = 1

    parked_before = len(av_fork._PARKED)
    out_end, in_end = multiprocessing.Pipe(duplex=False)

    def in_child():
        in_end.send((per_thread.reformatter is None, len(av_fork._PARKED) - parked_before))

    child = multiprocessing.get_context("fork").Process(target=in_child)
    child.start()
    assert out_end.recv() == (True, 1)  # empty, the parent's scalers parked (not freed)
    child.join(timeout=30)
    assert child.exitcode == 0 and per_thread.reformatter is mine
