"""The loader bench's Megatron-Energon baseline (tools/bench/loader_energon.py): it hands over
PackedBatches of the image source whose samples are those our decoder makes of the same keys,
read from the tars without Energon; ``energon prepare`` runs once per source."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.energon")

from omniscale.tools.bench import loader_energon as energon  # noqa: E402
from tests.demo_data import copy_demo  # noqa: E402

PACK = 4


def tar_samples(source: Path) -> dict[str, tuple[tuple[str, bytes], ...]]:
    """Every sample of a source's tars, by key, read with ``tarfile``: (member name, bytes)."""
    out: dict[str, list] = {}
    for shard in sorted(source.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                if m.isfile():
                    out.setdefault(m.name.split(".", 1)[0], []).append(
                        (m.name, tar.extractfile(m).read()))
    return {k: tuple(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def data(demo_root, tmp_path_factory) -> Path:
    """A copy of the demo: energon prepare writes .nv-meta beside the tars."""
    root = tmp_path_factory.mktemp("energon")
    copy_demo(demo_root, root / "demo")
    return root


def test_energon_batches_are_our_decoding_of_the_same_samples(data, monkeypatch):
    from omniscale.dataplane.spec import load_spec
    from omniscale.loaders.collate import collate
    from omniscale.loaders.decode import SampleDecoder
    from omniscale.loaders.readers import RawSample, SampleReader
    from omniscale.refs import SampleRef
    from omniscale.tools.bench.loader import demo_spec

    spec_path = demo_spec(data, "image")
    spec = load_spec(spec_path)
    source = Path(next(s.path for s in spec.sources if s.name == "image_caption"))

    batch = energon.OmniTaskEncoder.batch

    @energon.stateless
    def keyed(self, samples):  # the batch names its samples' keys (test only)
        out = batch(self, samples)
        out.seq_refs = [s.__key__ for s in samples]
        return out

    monkeypatch.setattr(energon.OmniTaskEncoder, "batch", keyed)
    loader = energon.energon_loader(spec_path, 2, {"image_caption": 1.0}, PACK)
    it = iter(loader)
    got = [next(it) for _ in range(12)]
    it.close()
    del loader

    raw = tar_samples(source)
    decoder = SampleDecoder(SampleReader({}), spec.tokenizer, spec.media)
    seen = set()
    for b in got:
        assert type(b).__name__ == "PackedBatch" and len(b.seq_refs) == PACK
        want = collate([(decoder.decode_raw(SampleRef(0, "image_caption", "", k, 0, 0),
                                            RawSample("image_caption", k, raw[k])), 1, 0)
                        for k in b.seq_refs], spec.media)
        for name, value in vars(want).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(getattr(b, name), value), name
        assert b.max_seqlen == want.max_seqlen and b.num_tokens > 0
        seen.update(b.seq_refs)
    assert len(seen) >= 24  # not one sample over and over

    prepared = source / ".nv-meta" / energon.STAMP
    mtime = prepared.stat().st_mtime_ns
    energon.prepare(spec, {"image_caption"})  # already prepared, tars unchanged: nothing to do
    assert prepared.stat().st_mtime_ns == mtime
    others = [Path(s.path) / ".nv-meta" for s in spec.sources if s.name != "image_caption"]
    assert others and not any(p.exists() for p in others)  # only the blended source prepared


def test_run_energon_reports_as_the_webdataset_baseline(data):
    from omniscale.tools.bench.loader import demo_spec

    result = energon.run_energon(demo_spec(data, "image"), samples=16, workers=1,
                                 weights={"image_caption": 1.0}, pack=PACK)
    assert set(result) == {"samples", "tokens", "seconds", "samples_per_s", "tokens_per_s",
                           "bytes_per_sample"}
    assert result["samples"] == 16 and result["tokens"] > 0 and result["bytes_per_sample"] > 0
