"""``omniscale data index``: write each source's index, re-indexing only what changed.

A source is a directory of shards of one format. Shards are indexed in parallel (one task per
shard, spawned worker processes that each load the tokenizer once) and their rows concatenated
in shard order, so the file is the same whatever the worker count. The index metadata records a
fingerprint (size, mtime) per shard with the geometry and tokenizer the features were computed
with; a re-index reuses the rows of unchanged shards unless ``force`` is set or the geometry or
tokenizer changed, drops rows of deleted shards, and replaces the file atomically.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from omniscale.dataplane.errors import UserError
from omniscale.loaders.chat import ChatFormat, chat_format
from omniscale.loaders.geometry import MediaGeometry
from omniscale.loaders.index_schema import (
    INDEX_FILENAME,
    INDEX_SCHEMA,
    INDEX_VERSION,
    METADATA_KEY,
    index_path,
    read_index_metadata,
)
from omniscale.loaders.layout import DEFAULT_SPECIAL_TOKENS, FORMATS, SpecialTokens
from omniscale.loaders.shard_index import ShardResult, index_shard
from omniscale.loaders.text_cost import TokenCounter, find_tokenizer, tokenizer_fingerprint

SHARD_SUFFIX = {"webdataset": ".tar", "parquet": ".parquet", "jsonl": ".jsonl"}
SPEC_SUFFIXES = (".yaml", ".yml")


@dataclass
class IndexReport:
    """What one source's indexing did; ``errors`` holds one line per corrupt sample."""

    source: str
    source_dir: Path
    shards_total: int = 0
    shards_indexed: int = 0
    shards_unchanged: int = 0
    samples: int = 0
    corrupt: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (f"{self.source}: {self.samples} samples in {self.shards_total} shards "
                f"({self.shards_indexed} indexed, {self.shards_unchanged} unchanged), "
                f"{self.corrupt} corrupt, {self.seconds:.1f} s -> "
                f"{shown(index_path(self.source_dir))}")


def index_paths(paths: list[str | Path], tokenizer: str | Path | None = None,
                workers: int | None = None, force: bool = False,
                progress: bool = True) -> list[IndexReport]:
    """Index every source named by ``paths``: mixing specs (all their sources) or directories.

    A directory's format is inferred from its files, its tokenizer is ``tokenizer`` or the
    nearest ``tokenizer.json`` above it, and its geometry is that of its existing index (so a
    directory indexed through a spec keeps the spec's geometry) or the defaults.
    """
    reports = []
    with ExitStack() as stack:
        # One pool for every source: starting workers costs more than indexing a small source.
        pool = _LazyPool(stack, workers)
        for path in map(Path, paths):
            reports += _index_path(path, tokenizer, pool, force, progress)
    return reports


def _index_path(path: Path, tokenizer: str | Path | None, pool: _LazyPool, force: bool,
                progress: bool) -> list[IndexReport]:
    if path.is_file() and path.suffix in SPEC_SUFFIXES:
        from omniscale.dataplane.spec import load_spec

        spec = load_spec(path)
        return [index_source(source.path, source.format, tokenizer or spec.tokenizer,
                             spec.media, workers=pool.workers, force=force, progress=progress,
                             name=source.name, pool=pool, special=spec.special_tokens,
                             chat=_chat_of(path, i, source, spec.tokenizer))
                for i, source in enumerate(spec.sources)]
    if path.is_dir():  # the geometry, special tokens and chat template of its last index,
        meta = read_index_metadata(path)  # or the defaults
        geometry = MediaGeometry.from_dict(meta["geometry"]) if meta.get("geometry") else \
            MediaGeometry()
        special = SpecialTokens(**meta.get("special_tokens", {}))
        chat = ChatFormat.from_dict(meta["chat"]) if meta.get("chat") else None
        return [index_source(path, infer_format(path), tokenizer or find_tokenizer(path),
                             geometry, workers=pool.workers, force=force, progress=progress,
                             pool=pool, special=special, chat=chat)]
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    raise UserError(f"{path}: neither a mixing spec (.yaml) nor a source directory")


def _chat_of(spec_path: Path, i: int, source, tokenizer: Path) -> ChatFormat | None:
    """A conversation source's template, read now (a one-line error naming the field)."""
    if source.chat_template is None:
        return None
    try:
        return chat_format(source.chat_template, tokenizer, source.train_on_prompt)
    except UserError as e:
        raise UserError(f"{spec_path}: sources[{i}].chat_template: {e}") from None


class _LazyPool:
    """A process pool started on first use (a source with nothing to re-index needs none)."""

    def __init__(self, stack: ExitStack, workers: int | None):
        self.workers = workers or os.cpu_count() or 1
        self._stack = stack
        self._pool: Executor | None = None

    def get(self) -> Executor:
        if self._pool is None:
            # spawn: tokenizers' thread pool does not survive a fork.
            self._pool = ProcessPoolExecutor(self.workers,
                                             mp_context=multiprocessing.get_context("spawn"))
            # On an error (a UserError from one shard, ^C) the queued shards are not worth
            # waiting for.
            self._stack.callback(self._pool.shutdown, wait=True, cancel_futures=True)
        return self._pool


def index_source(source_dir: str | Path, fmt: str, tokenizer_path: str | Path,
                 geometry: MediaGeometry, workers: int | None = None, force: bool = False,
                 progress: bool = True, name: str | None = None,
                 pool: _LazyPool | None = None,
                 special: SpecialTokens = DEFAULT_SPECIAL_TOKENS,
                 chat: ChatFormat | None = None) -> IndexReport:
    """Write ``source_dir/_index.parquet`` and report what was indexed and what is corrupt.

    ``pool`` lets several sources share worker processes (see :func:`index_paths`); ``chat``:
    a conversation source's template (``loaders.chat``), recorded in the index.
    """
    started = time.perf_counter()
    source_dir = Path(source_dir)
    if fmt not in FORMATS:
        raise UserError(f"{source_dir}: unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if not Path(tokenizer_path).is_file():
        raise UserError(f"{tokenizer_path}: no such tokenizer file")
    # a bad tokenizer, or one without the special tokens, is one line here, not in a worker
    TokenCounter.from_file(tokenizer_path, special)
    shards = list_shards(source_dir, fmt)
    fingerprints = {s: shard_fingerprint(source_dir / s) for s in shards}
    settings = {"version": INDEX_VERSION, "format": fmt, "geometry": geometry.to_dict(),
                "tokenizer_sha256": tokenizer_fingerprint(tokenizer_path)}
    if special != DEFAULT_SPECIAL_TOKENS:  # (indexes made with the defaults do not say so)
        settings["special_tokens"] = asdict(special)
    if chat is not None:
        settings["chat"] = chat.to_dict()
    old_meta, old_rows = _reusable(source_dir, settings, force)
    old_shards = old_meta.get("shards", {})
    unchanged = [s for s in shards if s in old_rows and _same(old_shards.get(s), fingerprints[s])]
    todo = sorted(set(shards) - set(unchanged))
    report = IndexReport(name or source_dir.name, source_dir, len(shards), len(todo),
                         len(unchanged))
    with ExitStack() as stack:
        pool = pool or _LazyPool(stack, workers)
        results = _run(source_dir, fmt, str(tokenizer_path), geometry, todo, pool, progress,
                       report.source, special, chat)
    tables, shard_meta = [], {}
    for shard in shards:
        if shard in results:
            table, problems = results[shard].table, results[shard].problems
        else:
            table, problems = old_rows[shard], old_shards[shard].get("problems", [])
        tables.append(table)
        shard_meta[shard] = {**fingerprints[shard], "problems": problems}
        errors = table.column("error").drop_null().to_pylist()
        report.errors += [f"{shown(source_dir / shard)}: {e}" for e in (*errors, *problems)]
    samples = _write_atomically(list(zip(shards, tables)), {**settings, "shards": shard_meta},
                                index_path(source_dir))
    report.samples = samples
    report.corrupt = len(report.errors)
    report.seconds = time.perf_counter() - started
    if progress:
        print(report.summary())
    return report


def infer_format(source_dir: Path) -> str:
    """The one format whose shards the directory holds; a UserError if none or several."""
    found = [fmt for fmt in FORMATS if list_shards(source_dir, fmt, required=False)]
    if len(found) != 1:
        what = "no shards" if not found else f"shards of several formats ({', '.join(found)})"
        raise UserError(f"{source_dir}: {what}; a source directory holds *.tar, *.parquet or "
                        "*.jsonl shards of one format")
    return found[0]


def list_shards(source_dir: Path, fmt: str, required: bool = True) -> list[str]:
    """Shard paths relative to ``source_dir``, sorted; names starting with ``_`` or ``.``
    (the index, temporary files) are not shards."""
    if not source_dir.is_dir():
        raise UserError(f"{source_dir}: no such source directory")
    shards = sorted(p.relative_to(source_dir).as_posix()
                    for p in source_dir.rglob(f"*{SHARD_SUFFIX[fmt]}")
                    if p.is_file() and not any(part[0] in "_."
                                               for part in p.relative_to(source_dir).parts))
    if required and not shards:
        raise UserError(f"{source_dir}: no *{SHARD_SUFFIX[fmt]} shards (format {fmt})")
    return shards


def shard_fingerprint(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def shown(path: Path) -> str:
    """A path as messages show it: relative to the working directory when below it."""
    path = Path(path)
    if path.is_absolute() and path.is_relative_to(Path.cwd()):
        path = path.relative_to(Path.cwd())
    return path.as_posix()


def _same(old: dict | None, new: dict) -> bool:
    return old is not None and all(old.get(k) == v for k, v in new.items())


def _reusable(source_dir: Path, settings: dict, force: bool) -> tuple[dict, dict[str, pa.Table]]:
    """The old index's metadata and rows per shard, when they were made the same way."""
    meta = read_index_metadata(source_dir)
    if force or any(meta.get(k) != v for k, v in settings.items()):
        return {}, {}
    try:
        table = pq.read_table(index_path(source_dir))
    except (pa.ArrowException, OSError):
        return {}, {}
    # Rows are stored grouped by shard, so each shard's rows are one slice.
    shard_ids = pc.dictionary_encode(table.column("shard")).combine_chunks()
    codes = shard_ids.indices.to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.diff(codes, prepend=-1)) if len(codes) else np.array([], int)
    ends = np.append(starts[1:], len(codes))
    names = shard_ids.dictionary.to_pylist()
    rows = {names[codes[a]]: table.slice(a, b - a) for a, b in zip(starts, ends)}
    # A shard whose samples were all unreadable has no rows but may still be unchanged.
    for shard in meta.get("shards", {}):
        rows.setdefault(shard, INDEX_SCHEMA.empty_table())
    return meta, rows


def _run(source_dir: Path, fmt: str, tokenizer_path: str, geometry: MediaGeometry,
         shards: list[str], pool: _LazyPool, progress: bool, label: str,
         special: SpecialTokens = DEFAULT_SPECIAL_TOKENS, chat: ChatFormat | None = None
         ) -> dict[str, ShardResult]:
    """Index ``shards``, in worker processes when more than one is worth it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    args = [(str(source_dir), s, fmt, tokenizer_path, geometry.to_dict(),
             shown(source_dir / s), special, chat.to_dict() if chat else None) for s in shards]
    console = Console(stderr=True)
    bar = Progress("[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeRemainingColumn(), console=console,
                   transient=True, disable=not (progress and console.is_terminal))
    results: dict[str, ShardResult] = {}
    with bar:
        task = bar.add_task(f"indexing {label}", total=len(shards))
        if pool.workers <= 1 or len(shards) <= 1:
            for a in args:
                results[a[1]] = index_shard(*a)
                bar.advance(task)
            return results
        for future in as_completed([pool.get().submit(index_shard, *a) for a in args]):
            result = future.result()
            results[result.shard] = result
            bar.advance(task)
    return results


def _write_atomically(shard_tables: list[tuple[str, pa.Table]], metadata: dict,
                      path: Path) -> int:
    """Write one row group per shard; readers see the old index or the new one, never a
    half-written file. Returns the number of rows.

    A row group per shard lets the data plane read just the shard it has open
    (:func:`loaders.index_schema.read_shard`) instead of holding every source's whole index.
    """
    rows, group = 0, 0
    for shard, table in shard_tables:
        metadata["shards"][shard]["row_group"] = group if table.num_rows else None
        metadata["shards"][shard]["rows"] = table.num_rows
        group += bool(table.num_rows)
    schema = INDEX_SCHEMA.with_metadata({METADATA_KEY: json.dumps(metadata, sort_keys=True)})
    tmp = path.with_name(f"_{INDEX_FILENAME}.{os.getpid()}.tmp")
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            for _, table in shard_tables:
                if table.num_rows:
                    writer.write_table(table.cast(INDEX_SCHEMA).replace_schema_metadata(
                        schema.metadata), row_group_size=table.num_rows)
                    rows += table.num_rows
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return rows
