"""Python's cycle collector held off while the plane builds a window.

A plane holds its windows' refs, arrays and tables: millions of objects at thousands of
ranks. Building a window allocates hundreds of thousands more, so the collector runs its
young generations every few hundred allocations and its full pass -- a walk over every object
the plane holds -- each time the heap grew by a quarter, several times a window (a tenth of a
4,096-rank window's time, ``tools/bench/plane.py``). What a window allocates holds no cycles
(refs, tuples, arrays, Arrow tables: freed by reference counting); pausing the collector
while it is built lets it run once afterwards instead of throughout.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Disable the cycle collector for the block, then restore it as it was (a caller that
    disabled it keeps it disabled; nested or concurrent blocks re-enable it only from the
    outermost one that found it on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
