"""The long-document source (``tools/demo/long_docs.py``): lengths drawn from the stated
bounded Pareto law (checked against its CDF), documents that hold those lengths under the
tokenizer, byte-identical rebuilds."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from omniscale.tools.demo import long_docs, text
from omniscale.tools.demo.tokenizer import train_tokenizer


def pareto_cdf(x, lo, hi, alpha):
    """P(L <= x) of the bounded Pareto law on [lo, hi] (written out: the oracle)."""
    return (1 - (lo / x) ** alpha) / (1 - (lo / hi) ** alpha)


def test_lengths_follow_the_bounded_pareto_law():
    lo, hi, alpha = 1024, 8191, 0.5
    x = long_docs.doc_lengths(20000, seed=3, min_tokens=lo, max_tokens=hi, alpha=alpha)
    assert x.dtype == np.int64 and x.min() >= lo and x.max() <= hi
    # Kolmogorov-Smirnov distance to the law (floored draws: compare at x + 1)
    grid = np.unique(x)
    empirical = np.searchsorted(np.sort(x), grid, side="right") / len(x)
    assert np.abs(empirical - pareto_cdf(np.minimum(grid + 1.0, hi), lo, hi, alpha)).max() < 0.015
    # long-tailed: median near lo/(1 - (1 - (lo/hi)^a) / 2)^(1/a) ≈ 2,236, the mean well above
    # it, a fifth of the documents over 4,096 tokens, the longest tenth a quarter of the tokens
    assert 2100 < np.median(x) < 2400 and x.mean() > 1.2 * np.median(x)
    assert 0.18 < (x > 4096).mean() < 0.26
    top = np.sort(x)[::-1][:len(x) // 10]
    assert top.sum() / x.sum() > 0.22
    # deterministic in the seed
    assert np.array_equal(x, long_docs.doc_lengths(20000, 3, lo, hi, alpha))
    assert not np.array_equal(x[:50], long_docs.doc_lengths(50, 4, lo, hi, alpha))
    with pytest.raises(ValueError):
        long_docs.doc_lengths(3, 0, 10, 5)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A small BPE tokenizer (the demo's trainer, 512 tokens) over a few stdlib files."""
    root = text.stdlib_root()
    sample = [(root / f).read_text(encoding="utf-8", errors="replace")
              for f in text.stdlib_files(root)[:40]]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(sample, [], path, vocab_size=512)
    return path


def read_docs(folder: Path) -> list[tuple[str, dict]]:
    docs = []
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name in sorted(n for n in members if n.endswith(".txt")):
            key = name[:-len(".txt")]
            docs.append((members[name].decode(), json.loads(members[key + ".json"])))
    return docs


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_documents_hold_their_drawn_lengths_and_rebuild_identically(tokenizer, tmp_path):
    n, lo, hi = 10, 64, 600
    summary = long_docs.build(tmp_path / "a", tokenizer, n, seed=1, min_tokens=lo,
                              max_tokens=hi, shard_size=4)
    assert sorted(summary["files"]) == [f"long_docs-00000{j}.tar" for j in range(3)]
    docs = read_docs(tmp_path / "a")
    want = long_docs.doc_lengths(n, 1, lo, hi)
    assert [meta["doc"] for _, meta in docs] == list(range(n))
    tok = Tokenizer.from_file(str(tokenizer))
    counts = [len(tok.encode(doc, add_special_tokens=False).ids) for doc, _ in docs]
    assert counts == summary["tokens"] == [meta["tokens"] for _, meta in docs]
    assert all(c <= hi for c in counts)
    assert np.abs(np.array(counts) - want).max() <= 2  # cut at token boundaries
    assert all(meta["files"] and all(f.endswith(".py") for f in meta["files"])
               for _, meta in docs)
    assert len({doc for doc, _ in docs}) == n
    # the same build again: the same bytes; in place: nothing rewritten
    long_docs.build(tmp_path / "b", tokenizer, n, seed=1, min_tokens=lo, max_tokens=hi,
                    shard_size=4)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").iterdir()}
    assert long_docs.build(tmp_path / "a", tokenizer, n, seed=1, min_tokens=lo, max_tokens=hi,
                           shard_size=4) == summary
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").iterdir()} == mtimes
    # another seed replaces the build; a folder that is not one is refused
    other = long_docs.build(tmp_path / "a", tokenizer, n, seed=2, min_tokens=lo, max_tokens=hi,
                            shard_size=4)
    assert other["tokens"] != summary["tokens"]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="refusing"):
        long_docs.build(tmp_path / "c", tokenizer, 2, seed=1, min_tokens=lo, max_tokens=hi)


def test_the_indexer_reads_them_as_text(tokenizer, tmp_path):
    """Indexed as a ``text`` source: each document's LLM tokens are its tokens and the
    end-of-text token the template adds (what tools/bench/e2e_long_tail.py sizes for)."""
    import pyarrow.parquet as pq

    from omniscale.geometry import MediaGeometry
    from omniscale.loaders.index import index_source
    from omniscale.tools.demo.specs import MEDIA

    summary = long_docs.build(tmp_path / "d", tokenizer, 5, seed=5, min_tokens=32,
                              max_tokens=200, shard_size=2)
    report = index_source(tmp_path / "d", "webdataset", tokenizer, MediaGeometry.from_dict(MEDIA),
                          workers=1, progress=False)
    assert not report.corrupt
    rows = pq.read_table(tmp_path / "d" / "_index.parquet",
                         columns=["key", "llm_tokens", "error"]).to_pylist()
    assert [r["key"] for r in rows] == [f"train-{i:06d}" for i in range(5)]
    assert [r["llm_tokens"] for r in rows] == [t + 1 for t in summary["tokens"]]
    assert all(r["error"] is None for r in rows)
