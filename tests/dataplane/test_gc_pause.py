"""The plane holds the cycle collector off while it builds a window, and gives it back as
it found it."""

from __future__ import annotations

import gc

import pytest

from omniscale.dataplane.gc_pause import collector_paused


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_on_again_after(collector_on):
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the inner block must not turn it on early
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_on_again_after_an_error(collector_on):
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("window")
    assert gc.isenabled()


def test_a_caller_that_turned_it_off_keeps_it_off(collector_on):
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()
