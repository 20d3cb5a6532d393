"""``omniscale data index``: write each source's index, re-indexing only what changed.

A source is a directory of shards of one format, local or under an object-store URL (read in
place: tar headers and media headers by ranged reads, ``loaders.ranged_file``). Shards are
indexed in parallel -- one task per shard, in spawned worker processes that each load the
tokenizer once, or as a Ray Data pipeline on a cluster (``loaders.index_ray``) -- and their rows
concatenated in shard order, so the file is the same whatever ran them. The index metadata
records a fingerprint per shard (size and mtime, or size and ETag) with the geometry and
tokenizer the features were computed with; a re-index reuses the rows of unchanged shards
unless ``force`` is set or the geometry or tokenizer changed, and drops rows of deleted shards.

The index goes beside the shards, or to ``index_dir/<source name>`` (a read-only bucket's
sources, indexed elsewhere); a local file is replaced atomically by a rename, a remote one by
one upload (an object store shows the old object or the new one, never a part).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from omniscale.errors import UserError
from omniscale.geometry import MediaGeometry
from omniscale.index_schema import (
    INDEX_FILENAME,
    INDEX_SCHEMA,
    INDEX_VERSION,
    METADATA_KEY,
    index_location,
    read_index,
    read_index_metadata,
)
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, FORMATS, SpecialTokens
from omniscale.loaders.chat import ChatFormat, chat_format
from omniscale.loaders.shard_index import ShardResult, index_shard
from omniscale.loaders.shard_listing import (  # noqa: F401 (the indexer's API, as before)
    SHARD_SUFFIX,
    infer_format,
    list_shards,
    remote_errors,
    shard_fingerprint,
    shown,
    source_shards,
)
from omniscale.loaders.text_cost import TokenCounter, find_tokenizer, tokenizer_fingerprint
from omniscale.location import Location, is_url

SPEC_SUFFIXES = (".yaml", ".yml")


@dataclass
class IndexReport:
    """What one source's indexing did; ``errors`` holds one line per corrupt sample."""

    source: str
    location: Location  # the shards
    index_at: Location  # the directory holding its _index.parquet
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
                f"{shown(index_location(self.index_at))}")


def index_paths(paths: "list[str | Path | Location]", tokenizer: str | Path | None = None,
                workers: int | None = None, force: bool = False, progress: bool = True,
                index_dir: "str | Path | None" = None, storage_options: dict | None = None,
                ray: "bool | str | None" = None, special_tokens: dict | None = None
                ) -> list[IndexReport]:
    """Index every source named by ``paths``: mixing specs (all their sources), directories
    or URLs.

    A directory's format is inferred from its files, its tokenizer is ``tokenizer`` or the
    nearest ``tokenizer.json`` above it (a URL needs ``tokenizer``), and its geometry is that
    of its existing index (so a directory indexed through a spec keeps the spec's geometry) or
    the defaults. ``storage_options``: fsspec options of URL arguments (a spec's sources carry
    their own). ``index_dir`` (a local directory or URL): write source NAME's index to
    ``index_dir/NAME/``; a spec must name the same ``index_dir`` (the plane reads it there).
    ``ray``: run the per-shard work as a Ray Data pipeline -- True for a local Ray instance
    (or the one ``RAY_ADDRESS`` names), or an address (``auto``, ``ray://head:10001``).
    ``special_tokens``: roles whose token is named over a spec's or an index's (a run's
    ``model.special_tokens``).
    """
    reports = []
    with ExitStack() as stack:
        # One pool for every source: starting workers costs more than indexing a small source.
        if ray is None or ray is False:
            runner = _LazyPool(stack, workers)
        else:
            from omniscale.loaders.index_ray import RayRunner

            runner = RayRunner(stack, None if ray is True else ray)
        for path in paths:
            reports += _index_path(path, tokenizer, runner, force, progress, index_dir,
                                   storage_options, special_tokens or {})
    return reports


def _index_path(where: "str | Path | Location", tokenizer: str | Path | None, runner,
                force: bool, progress: bool, index_dir: "str | Path | None",
                storage_options: dict | None, special_tokens: dict) -> list[IndexReport]:
    if isinstance(where, Location):
        loc = where
    elif is_url(where):
        loc = Location.of(where, storage_options)
    else:
        path = Path(where)
        if path.is_file() and path.suffix in SPEC_SUFFIXES:
            return _index_spec(path, tokenizer, runner, force, progress, index_dir,
                               special_tokens)
        loc = Location.of(path)
    with remote_errors(loc, "read the source"):
        is_dir = loc.is_dir()
        exists = is_dir or loc.exists()
    if not is_dir:
        what = "neither a mixing spec (.yaml) nor a source directory" if exists else \
            "no such file or directory"
        raise UserError(f"{where if loc.is_local else loc.shown()}: {what}")
    if tokenizer is None and not loc.is_local:
        raise UserError(f"{loc.shown()}: pass --tokenizer (no tokenizer.json is looked for "
                        "above a source in an object store)")
    index_at = loc if index_dir is None else _index_dir(index_dir, storage_options).join(
        loc.name)
    # the geometry, special tokens and chat template of its last index, or the defaults
    meta = read_index_metadata(index_at)
    geometry = MediaGeometry.from_dict(meta["geometry"]) if meta.get("geometry") else \
        MediaGeometry()
    special = replace(SpecialTokens(**meta.get("special_tokens", {})), **special_tokens)
    chat = ChatFormat.from_dict(meta["chat"]) if meta.get("chat") else None
    return [index_source(loc, infer_format(loc), tokenizer or find_tokenizer(loc.url),
                         geometry, force=force, progress=progress, pool=runner,
                         special=special, chat=chat, index_at=index_at)]


def _index_dir(index_dir: "str | Path", storage_options: dict | None) -> Location:
    """``--index-dir`` as a Location; a URL takes the sources' storage options."""
    return Location.of(index_dir, storage_options if is_url(index_dir) else None)


def _index_spec(path: Path, tokenizer: str | Path | None, runner, force: bool,
                progress: bool, index_dir: "str | Path | None", special_tokens: dict
                ) -> list[IndexReport]:
    from omniscale.dataplane.spec import load_spec

    spec = load_spec(path)
    if index_dir is not None:
        # The plane finds indexes through the spec: one written elsewhere would be lost.
        wanted = Location.of(index_dir)
        named = spec.sources[0].index_dir
        if named is None or Location.of(named).url != wanted.url:
            what = f"names index_dir: {named}" if named else "has no index_dir"
            raise UserError(f"{path}: --index-dir {index_dir}, but the spec {what}; put "
                            f"`index_dir: {wanted.shown()}` in the spec (the data plane "
                            "reads the indexes where it says)")
    return [index_source(source.location, source.format, tokenizer or spec.tokenizer,
                         spec.media, force=force, progress=progress, name=source.name,
                         pool=runner, special=replace(spec.special_tokens, **special_tokens),
                         chat=_chat_of(path, i, source, spec.tokenizer),
                         index_at=source.index)
            for i, source in enumerate(spec.sources)]


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

    def results(self, tasks: list[tuple]) -> Iterator[ShardResult]:
        """``index_shard(*task)`` of every task, as they finish; in this process when more
        than one is not worth it."""
        if self.workers <= 1 or len(tasks) <= 1:
            for task in tasks:
                yield index_shard(*task)
            return
        for future in as_completed([self.get().submit(index_shard, *t) for t in tasks]):
            yield future.result()


def index_source(source_dir: "str | Path | Location", fmt: str, tokenizer_path: str | Path,
                 geometry: MediaGeometry, workers: int | None = None, force: bool = False,
                 progress: bool = True, name: str | None = None,
                 pool=None, special: SpecialTokens = DEFAULT_SPECIAL_TOKENS,
                 chat: ChatFormat | None = None,
                 index_at: "str | Path | Location | None" = None) -> IndexReport:
    """Write ``index_at/_index.parquet`` (``index_at``: ``source_dir`` unless given) and
    report what was indexed and what is corrupt.

    ``source_dir``: a local directory, a URL or a :class:`Location` (URL plus storage
    options). ``pool`` lets several sources share worker processes or a Ray pipeline (see
    :func:`index_paths`); ``chat``: a conversation source's template (``loaders.chat``),
    recorded in the index.
    """
    started = time.perf_counter()
    source = Location.of(source_dir)
    index_at = source if index_at is None else Location.of(index_at)
    if fmt not in FORMATS:
        raise UserError(f"{shown(source)}: unknown format {fmt!r} (one of "
                        f"{', '.join(FORMATS)})")
    if not Path(tokenizer_path).is_file():
        raise UserError(f"{tokenizer_path}: no such tokenizer file")
    # a bad tokenizer, or one without the special tokens, is one line here, not in a worker
    TokenCounter.from_file(tokenizer_path, special)
    fingerprints = source_shards(source, fmt)
    shards = list(fingerprints)
    settings = {"version": INDEX_VERSION, "format": fmt, "geometry": geometry.to_dict(),
                "tokenizer_sha256": tokenizer_fingerprint(tokenizer_path)}
    if special != DEFAULT_SPECIAL_TOKENS:  # (indexes made with the defaults do not say so)
        settings["special_tokens"] = asdict(special)
    if chat is not None:
        settings["chat"] = chat.to_dict()
    old_meta, old_rows = _reusable(index_at, settings, force)
    old_shards = old_meta.get("shards", {})
    unchanged = [s for s in shards if s in old_rows and _same(old_shards.get(s), fingerprints[s])]
    todo = sorted(set(shards) - set(unchanged))
    report = IndexReport(name or source.name, source, index_at, len(shards), len(todo),
                         len(unchanged))
    tasks = [(source, s, fmt, str(tokenizer_path), geometry.to_dict(), shown(source.join(s)),
              special, chat.to_dict() if chat else None, fingerprints[s]["size"])
             for s in todo]
    with ExitStack() as stack:
        pool = pool or _LazyPool(stack, workers)
        if not source.is_local:  # a store that stops answering mid-run: one line, not a trace
            stack.enter_context(remote_errors(source, "read its shards"))
        results = _run(tasks, pool, progress, report.source)
    tables, shard_meta = [], {}
    for shard in shards:
        if shard in results:
            table, problems = results[shard].table, results[shard].problems
        else:
            table, problems = old_rows[shard], old_shards[shard].get("problems", [])
        tables.append(table)
        shard_meta[shard] = {**fingerprints[shard], "problems": problems}
        errors = table.column("error").drop_null().to_pylist()
        report.errors += [f"{shown(source.join(shard))}: {e}" for e in (*errors, *problems)]
    samples = _write_index(list(zip(shards, tables)), {**settings, "shards": shard_meta},
                           index_at)
    report.samples = samples
    report.corrupt = len(report.errors)
    report.seconds = time.perf_counter() - started
    if progress:
        print(report.summary())
    return report


def _same(old: dict | None, new: dict) -> bool:
    return old is not None and all(old.get(k) == v for k, v in new.items())


OPTIONAL_SETTINGS = ("special_tokens", "chat")  # recorded only when not the defaults


def _reusable(index_at: Location, settings: dict, force: bool
              ) -> tuple[dict, dict[str, pa.Table]]:
    """The old index's metadata and rows per shard, when they were made the same way."""
    meta = read_index_metadata(index_at)
    # the optional settings too: an index made with other special tokens or a chat template
    # is stale for a run with the defaults, which ``settings`` leaves out
    if force or any(meta.get(k) != settings.get(k) for k in {*settings, *OPTIONAL_SETTINGS}):
        return {}, {}
    try:
        table = read_index(index_at)
    except UserError:
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


def _run(tasks: list[tuple], pool, progress: bool, label: str) -> dict[str, ShardResult]:
    """Index the shards of ``tasks`` (``index_shard`` arguments) on ``pool``, with a bar."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    console = Console(stderr=True)
    bar = Progress("[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeRemainingColumn(), console=console,
                   transient=True, disable=not (progress and console.is_terminal))
    results: dict[str, ShardResult] = {}
    if not tasks:
        return results
    with bar:
        task = bar.add_task(f"indexing {label}", total=len(tasks))
        for result in pool.results(tasks):
            results[result.shard] = result
            bar.advance(task)
    return results


def _write_index(shard_tables: list[tuple[str, pa.Table]], metadata: dict,
                 index_at: Location) -> int:
    """Write one row group per shard; readers see the old index or the new one, never a
    half-written file: a local one is renamed into place, a remote one uploaded whole (an
    object appears when its upload completes). Returns the number of rows.

    A row group per shard lets the data plane read just the shard it has open
    (:func:`omniscale.index_schema.read_shard`) instead of holding every source's whole index.
    """
    target = index_location(index_at)
    if target.is_local:
        path = target.local_path()
        path.parent.mkdir(parents=True, exist_ok=True)  # an index_dir entry
        # a hidden name: listings that copy or scan a source (data copy, shard listing) skip it
        tmp = path.with_name(f".{INDEX_FILENAME}.{os.getpid()}.tmp")
        try:
            rows = _write_parquet(shard_tables, metadata, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return rows
    with tempfile.TemporaryDirectory(prefix="omniscale-index-") as scratch:
        tmp = Path(scratch) / INDEX_FILENAME
        rows = _write_parquet(shard_tables, metadata, tmp)
        fs, path = target.fs()
        try:
            with remote_errors(target, "write the index"):
                fs.put_file(str(tmp), path)
        except UserError as e:
            raise UserError(f"{e}; a read-only store's sources take --index-dir DIR "
                            "(a local directory or a writable URL)") from None
    return rows


def _write_parquet(shard_tables: list[tuple[str, pa.Table]], metadata: dict,
                   path: Path) -> int:
    rows, group = 0, 0
    for shard, table in shard_tables:
        metadata["shards"][shard]["row_group"] = group if table.num_rows else None
        metadata["shards"][shard]["rows"] = table.num_rows
        group += bool(table.num_rows)
    schema = INDEX_SCHEMA.with_metadata({METADATA_KEY: json.dumps(metadata, sort_keys=True)})
    with pq.ParquetWriter(path, schema) as writer:
        for _, table in shard_tables:
            if table.num_rows:
                writer.write_table(table.cast(INDEX_SCHEMA).replace_schema_metadata(
                    schema.metadata), row_group_size=table.num_rows)
                rows += table.num_rows
    return rows
