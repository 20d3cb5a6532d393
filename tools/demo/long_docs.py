"""A long-document text source: long-tailed lengths up to several micro-batches, on demand.

The demo's own ``text`` source keeps the stdlib's natural lengths, which no setting moves. The
long-tailed benchmark (``tools/bench/e2e_long_tail.py``) needs lengths it can state: documents
whose lengths, in tokens of the demo's tokenizer, follow a bounded Pareto law between
``min_tokens`` and ``max_tokens`` (shape ``alpha``: most documents short, a few as long as a
whole SP group holds). :func:`build` writes them next to a generated demo:

- text: one stream of real text -- the standard library's ``.py`` files in a seeded order,
  special tokens broken up as in the ``text`` source -- cut into consecutive documents, each
  cut at a token boundary of the tokenizer so it holds its drawn length (re-tokenised alone a
  document may come out a token or two off at the seams; never above ``max_tokens``);
- WebDataset tars of ``KEY.txt`` and ``KEY.json`` (``{"doc", "tokens", "target_tokens",
  "files"}``), template ``text``, so a spec takes it like the ``text`` source;
- a summary ``long_docs.json`` (parameters, shards, lengths), written last: :func:`build`
  returns at once when the folder already holds the same build.

Bytes depend only on (n, seed, min_tokens, max_tokens, alpha, shard_size), the tokenizer file
and this machine's standard library (as the ``text`` source's do).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from omniscale.errors import UserError
from omniscale.tools.demo import text, writer

SUMMARY_FILE = "long_docs.json"
NAME = "long_docs"
VERSION = 1
# seeds this source's generators; distinct from shards.SOURCE_IDS (the demo's sources)
STREAM_ID = 101
ALPHA = 0.5
FILES_PER_BATCH = 32  # stdlib files tokenised together


def doc_lengths(n: int, seed: int, min_tokens: int, max_tokens: int,
                alpha: float = ALPHA) -> np.ndarray:
    """``n`` document lengths (int64 tokens) drawn from the bounded Pareto law on
    [min_tokens, max_tokens] with shape ``alpha``: P(L > x) ∝ x^-alpha - max^-alpha, by the
    inverse CDF of seeded uniforms."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    if alpha <= 0:
        raise ValueError(f"alpha: must be > 0, got {alpha}")
    u = np.random.default_rng([seed, STREAM_ID, 0]).random(n)
    ratio = (min_tokens / max_tokens) ** alpha
    x = min_tokens / (1.0 - u * (1.0 - ratio)) ** (1.0 / alpha)
    return np.clip(np.floor(x), min_tokens, max_tokens).astype(np.int64)


def _file_stream(seed: int):
    """(relative path, text) of the stdlib's .py files in a seeded order, forever (a new
    order each pass); empty and non-UTF-8 files skipped."""
    root = text.stdlib_root()
    files = text.stdlib_files(root)
    for epoch in range(1 << 30):
        order = np.random.default_rng([seed, STREAM_ID, 1, epoch]).permutation(len(files))
        for i in order:
            try:
                body = (root / files[i]).read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            if body.strip():
                yield files[i], text.neutralize(body)


def documents(lengths: np.ndarray, tokenizer, seed: int) -> list[tuple[str, dict]]:
    """(text, provenance) of one document per length: consecutive cuts of the seeded file
    stream, each holding ``lengths[i]`` tokens of ``tokenizer`` (a ``tokenizers.Tokenizer``)
    as the files were tokenised, then trimmed if the document alone tokenises longer."""
    stream = _file_stream(seed)
    pending: list[tuple[str, str, list]] = []  # (path, text, token end offsets) not yet used

    def refill() -> None:
        batch = [next(stream) for _ in range(FILES_PER_BATCH)]
        encoded = tokenizer.encode_batch([body for _, body in batch], add_special_tokens=False)
        pending.extend((path, body, [end for _, end in enc.offsets])
                       for (path, body), enc in zip(batch, encoded) if enc.offsets)

    docs = []
    for i, want in enumerate(np.asarray(lengths, np.int64).tolist()):
        parts, paths, have = [], [], 0
        while have < want:
            if not pending:
                refill()
            path, body, ends = pending.pop(0)
            take = min(want - have, len(ends))
            cut = ends[take - 1]
            parts.append(body[:cut])
            paths.append(path)
            have += take
            if take < len(ends) and body[cut:].strip():  # the rest starts the next document
                pending.insert(0, (path, body[cut:], [e - cut for e in ends[take:]]))
        doc = "\n".join(parts)
        doc, tokens = _at_most(doc, tokenizer, want)
        docs.append((doc, {"doc": i, "tokens": tokens, "target_tokens": want, "files": paths}))
    return docs


def _at_most(doc: str, tokenizer, limit: int) -> tuple[str, int]:
    """``doc`` cut to at most ``limit`` tokens when tokenised alone, and its token count."""
    enc = tokenizer.encode(doc, add_special_tokens=False)
    while len(enc.ids) > limit:
        doc = doc[:enc.offsets[limit - 1][1]]
        enc = tokenizer.encode(doc, add_special_tokens=False)
    return doc, len(enc.ids)


def _params(n: int, seed: int, min_tokens: int, max_tokens: int, alpha: float,
            shard_size: int, tokenizer: Path) -> dict:
    return {"version": VERSION, "n": n, "seed": seed, "min_tokens": min_tokens,
            "max_tokens": max_tokens, "alpha": alpha, "shard_size": shard_size,
            "tokenizer_bytes": tokenizer.stat().st_size}


def _complete(dest: Path, params: dict) -> dict | None:
    try:
        summary = json.loads((dest / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if summary.get("params") != params:
        return None
    for name, size in summary.get("files", {}).items():
        path = dest / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return summary


def build(dest: Path, tokenizer: Path, n: int, seed: int = 0, min_tokens: int = 1024,
          max_tokens: int = 8192, alpha: float = ALPHA, shard_size: int = 64) -> dict:
    """Write ``n`` long documents as WebDataset shards into the folder ``dest`` (created,
    or replaced when it holds another build); returns the summary (also in
    ``dest/long_docs.json``). ``tokenizer``: the demo's ``tokenizer.json``."""
    from tokenizers import Tokenizer

    from omniscale.tools.demo.dataset import _ranges
    from omniscale.tools.demo.shards import sample_key

    dest, tokenizer = Path(dest), Path(tokenizer)
    params = _params(n, seed, min_tokens, max_tokens, alpha, shard_size, tokenizer)
    done = _complete(dest, params)
    if done is not None:
        return done
    if dest.exists() and any(dest.iterdir()) and not (dest / SUMMARY_FILE).is_file():
        raise UserError(f"{dest}: exists, is not empty and holds no {SUMMARY_FILE}; refusing "
                        "to replace it (choose a new or empty directory)")
    tok = Tokenizer.from_file(str(tokenizer))
    docs = documents(doc_lengths(n, seed, min_tokens, max_tokens, alpha), tok, seed)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        files = {}
        for j, (start, count) in enumerate(_ranges(n, shard_size)):
            name = f"{NAME}-{j:06d}.tar"
            files[name] = writer.write_tar(tmp / name, [
                (sample_key("train", start + o), text.text_members(*docs[start + o]))
                for o in range(count)])
        summary = {"params": params, "files": files,
                   "tokens": [meta["tokens"] for _, meta in docs]}
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary) + "\n")
        tmp.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary
