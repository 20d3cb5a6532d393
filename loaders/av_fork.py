"""PyAV's per-thread scaler across a fork: kept alive in the child, never used there.

Since PyAV 18.1.1, ``VideoFrame.reformat`` (and so ``to_ndarray(format=...)``,
``to_image()``) keeps one FFmpeg scaler per thread in a ``threading.local``
(``av.video.frame._thread_local``). Its ``SwsContext`` runs slice threads. When a process
forks from a thread other than the one that made a scaler, the child deletes the other
threads' states and with them their thread-local values: the scaler is freed in the child,
where ``avpriv_slicethread_free`` waits in ``pthread_cond_destroy`` for slice threads that
were not forked -- forever. The loader forks its workers from its assembly thread, so one
``frame.to_ndarray(format="rgb24")`` anywhere in the trainer's main thread (a user's preview,
a test) hung every worker at birth (seen: CI's loader tests with 18.1.1; py-spy showed the
workers in ``VideoReformatter.__dealloc__`` inside ``os.fork``).

:func:`keep_scalers_across_fork` replaces PyAV's thread-local with :class:`ScalerPerThread`:
the same one scaler per thread, held in a plain dict owned by the process that made it. A
child's thread cleanup does not reach that dict; the child's first use sees another pid,
parks the parent's scalers (never freed, never used: their threads are not there) and starts
its own. The parent frees a dead thread's scaler when another thread makes one, where the
slice threads still run. Nothing to do for a PyAV without the thread-local (<= 18.1.0: a
scaler per frame, freed with it).
"""

from __future__ import annotations

import os
import sys
import threading

_PARKED: list[dict] = []  # in a child: its parent's scalers, kept so that none is freed here
_ATTRIBUTE = "reformatter"  # the one name PyAV stores on its thread-local


class ScalerPerThread:
    """Stands in for PyAV's ``threading.local``: ``.reformatter`` is this thread's scaler (or
    None), set once per thread by PyAV; after a fork the child starts empty."""

    def __init__(self) -> None:
        object.__setattr__(self, "_pid", os.getpid())
        object.__setattr__(self, "_by_thread", {})

    def _own(self) -> dict:
        if self._pid != os.getpid():  # the first use in a forked child
            _PARKED.append(self._by_thread)
            object.__setattr__(self, "_pid", os.getpid())
            object.__setattr__(self, "_by_thread", {})
        return self._by_thread

    # Keyed by the Thread object, not its ident: the system reuses a finished thread's ident.
    def __getattr__(self, name: str):
        if name != _ATTRIBUTE:
            raise AttributeError(name)
        return self._own().get(threading.current_thread())

    def __setattr__(self, name: str, value) -> None:
        if name != _ATTRIBUTE:
            raise AttributeError(f"ScalerPerThread holds only {_ATTRIBUTE!r}, not {name!r}")
        scalers = self._own()
        for thread in [t for t in scalers if not t.is_alive()]:
            del scalers[thread]  # it ended: its scaler is freed here, where the slices run
        scalers[threading.current_thread()] = value


def keep_scalers_across_fork() -> None:
    """Before a fork: make PyAV's per-thread scalers survive it (see the module's doc). Only
    where PyAV is imported (else no scaler exists) and has the thread-local; idempotent.
    Swapping frees the old thread-local's scalers here, in the parent, which is safe."""
    frame = sys.modules.get("av.video.frame")
    if frame is not None and hasattr(frame, "_thread_local") and \
            not isinstance(frame._thread_local, ScalerPerThread):
        frame._thread_local = ScalerPerThread()
