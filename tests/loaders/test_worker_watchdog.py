"""The decode watchdog: a work item's samples go to the decode thread in one hand-off, each
sample gets its own deadline, and only the sample that overruns it is lost (timed out); the
rest of the item is decoded by a fresh decoder."""

from __future__ import annotations

import threading
import time

import pytest

from omniscale.loaders.worker import TimedDecoder
from omniscale.refs import SampleRef


class _Reader:
    def close(self) -> None:
        pass


class _Decoder:
    """Decodes a ref to its key; ``hang`` keys block forever (a stuck C call), ``slow`` keys
    take ``slow_s`` seconds each. Records which decoder (by build number) and thread did what."""

    def __init__(self, number: int, log: list, hang: set, slow: set, slow_s: float) -> None:
        self.number, self.log, self.hang, self.slow, self.slow_s = number, log, hang, slow, slow_s
        self.reader = _Reader()

    def decode(self, ref, need=None):
        self.log.append((ref.key, self.number, threading.get_ident()))
        if ref.key in self.hang:
            threading.Event().wait()
        if ref.key in self.slow:
            time.sleep(self.slow_s)  # the decode's own work, not synchronisation
        return ref.key


class _Spec:
    def __init__(self, hang=(), slow=(), slow_s=0.0) -> None:
        self.log, self.built = [], 0
        self.hang, self.slow, self.slow_s = set(hang), set(slow), slow_s

    def build(self) -> _Decoder:
        self.built += 1
        return _Decoder(self.built, self.log, self.hang, self.slow, self.slow_s)


def _work(*keys):
    return [(SampleRef(0, "src", "shard.tar", k, 0, 0), None) for k in keys]


@pytest.mark.timeout(30)
def test_one_hung_sample_times_out_and_the_rest_of_the_item_is_decoded():
    spec = _Spec(hang={"c"})
    decoder = TimedDecoder(spec, timeout=0.5)
    outs = decoder.decode_all(_work("a", "b", "c", "d", "e"))
    assert [o.sample for o in outs] == ["a", "b", None, "d", "e"]
    assert outs[2].error is not None and outs[2].error.key == "c"
    assert str(outs[2].error).endswith("decode timed out after 0.5 s")
    assert decoder.timeouts == 1
    # a, b, c on the first decoder's thread, in one hand-off; d, e on a fresh one
    by_key = {k: (n, t) for k, n, t in spec.log}
    assert by_key["a"] == by_key["b"] == by_key["c"]
    assert by_key["d"] == by_key["e"] and by_key["d"][0] == 2 != by_key["c"][0]
    assert by_key["d"][1] != by_key["c"][1] != threading.get_ident()
    decoder.close()


@pytest.mark.timeout(30)
def test_the_deadline_is_per_sample_not_per_item():
    """Four samples of 0.3 s each take longer than the 0.5 s timeout together, but none does
    alone: nothing times out and one decoder does them all."""
    spec = _Spec(slow={"a", "b", "c", "d"}, slow_s=0.3)
    decoder = TimedDecoder(spec, timeout=0.5)
    outs = decoder.decode_all(_work("a", "b", "c", "d"))
    assert [o.sample for o in outs] == ["a", "b", "c", "d"]
    assert decoder.timeouts == 0 and spec.built == 1
    # a later item reuses the same decode thread
    assert decoder.decode(_work("e")[0][0]).sample == "e"
    assert len({t for *_, t in spec.log}) == 1 and spec.built == 1
    decoder.close()


def test_without_a_timeout_the_caller_decodes():
    spec = _Spec()
    decoder = TimedDecoder(spec, timeout=None)
    assert [o.sample for o in decoder.decode_all(_work("a", "b"))] == ["a", "b"]
    assert {t for *_, t in spec.log} == {threading.get_ident()}
