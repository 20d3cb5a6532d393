"""``omniscale data import``: conversation datasets into a WebDataset source, resumably.

Input files (``*.json`` / ``*.jsonl``, named or found under directories) are converted in
parallel, one task per file (:func:`loaders.importers.convert.convert_file`). ``OUT/_import.json``
(the manifest) records the import's settings and, per converted input file, its fingerprint,
shards and skipped records; a rerun with the same arguments skips files the manifest holds
unchanged, drops the shards of files that changed or are gone, and converts the rest, so an
interrupted import finishes as if it had never stopped. ``OUT/_skipped.jsonl`` lists every
skipped record, in input order. Both start with ``_``: ``omniscale data index OUT`` takes them
for no shard.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from omniscale.errors import UserError
from omniscale.loaders.importers.convert import FORMATS, FileResult, FileTask, convert_file

MANIFEST = "_import.json"
SKIPPED = "_skipped.jsonl"
MANIFEST_VERSION = 1
INPUT_SUFFIXES = (".json", ".jsonl")
DEFAULT_SAMPLES_PER_SHARD = 1000
ENTRY_KEYS = ("size", "mtime_ns", "shards", "samples", "skipped")
MANIFEST_EVERY_S = 1.0  # a lost manifest update costs only a file converted again


@dataclass
class ImportReport:
    """What an import did. ``skipped`` holds every skipped record (``file``, ``line``,
    ``category``, ``reason``) in input order, this run's and the runs' it resumed."""

    out: Path
    files: int = 0
    files_converted: int = 0
    samples: int = 0
    shards: int = 0
    skipped: list[dict] = field(default_factory=list)
    inputs: dict[str, Path] = field(default_factory=dict)  # rel -> the file
    seconds: float = 0.0

    def lines(self) -> list[str]:
        """``file:line: reason`` per skipped record, the file as the user names it."""
        return [f"{_shown(self.inputs.get(s['file'], s['file']))}"
                f"{':' + str(s['line']) if s['line'] else ''}: {s['reason']}"
                for s in self.skipped]

    def summary(self) -> str:
        done_before = self.files - self.files_converted
        text = (f"imported {self.samples} conversation(s) from {self.files} file(s) "
                f"({self.files_converted} converted now, {done_before} done before) into "
                f"{self.shards} shard(s) in {_shown(self.out)}, {self.seconds:.1f} s")
        if self.skipped:
            reasons = Counter(s["category"] for s in self.skipped)
            text += (f"; skipped {len(self.skipped)} (" +
                     ", ".join(f"{reason}: {n}" for reason, n in reasons.most_common()) +
                     f"), listed in {_shown(self.out / SKIPPED)}")
        return text


def import_conversations(fmt: str, sources: list[str | Path], out: str | Path, *,
                         media_root: str | Path | None = None,
                         samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
                         workers: int | None = None, force: bool = False,
                         progress: bool = True) -> ImportReport:
    """Convert ``sources`` (files or directories) of format ``fmt`` into shards in ``out``.

    Resumes an interrupted import into ``out`` made with the same settings; ``force`` starts
    over. Raises :class:`UserError` for bad arguments, never for a bad record.
    """
    started = time.perf_counter()
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if samples_per_shard < 1:
        raise UserError(f"--samples-per-shard: must be >= 1, got {samples_per_shard}")
    if workers is not None and workers < 1:
        raise UserError(f"--workers: must be >= 1, got {workers}")
    if media_root is not None and not Path(media_root).is_dir():
        raise UserError(f"--media-root {media_root}: no such directory")
    inputs = list_inputs(sources)
    out = Path(out)
    settings = {"format": fmt, "samples_per_shard": samples_per_shard,
                "media_root": os.path.abspath(media_root) if media_root else None}
    manifest = Manifest.open(out, settings, force)
    fingerprints = {rel: _fingerprint(path) for rel, path in inputs.items()}
    manifest.keep(fingerprints)
    todo = [FileTask(fmt, str(path), rel, file_stem(rel), str(out), samples_per_shard,
                     settings["media_root"])
            for rel, path in inputs.items() if rel not in manifest.files]
    todo.sort(key=lambda t: -fingerprints[t.rel]["size"])  # biggest first: a short tail
    try:
        for result in _run(todo, workers, progress, fmt, sum(fingerprints[t.rel]["size"]
                                                             for t in todo)):
            manifest.add(result, fingerprints[result.rel])
    finally:  # ^C too: what was converted stays converted
        manifest.write(order=list(inputs))
    report = ImportReport(out, len(inputs), len(todo), inputs=inputs)
    for entry in manifest.files.values():
        report.samples += entry["samples"]
        report.shards += len(entry["shards"])
        report.skipped += entry["skipped"]
    _write_atomically(out / SKIPPED, "".join(json.dumps(s, ensure_ascii=False) + "\n"
                                             for s in report.skipped))
    report.seconds = time.perf_counter() - started
    return report


def list_inputs(sources: list[str | Path]) -> dict[str, Path]:
    """rel -> path of every input file, sorted by rel: named files, and ``*.json`` /
    ``*.jsonl`` under named directories (names starting with ``_`` or ``.`` left out). ``rel``
    is relative to the deepest directory holding every source."""
    if not sources:
        raise UserError("no input: name input files or directories")
    bases, files = [], []
    for source in map(Path, sources):
        if source.is_dir():
            bases.append(os.path.abspath(source))
            files += [p for p in source.rglob("*")
                      if p.suffix.lower() in INPUT_SUFFIXES and p.is_file()
                      and not any(part[0] in "_." for part in p.relative_to(source).parts)]
        elif source.is_file():
            bases.append(os.path.dirname(os.path.abspath(source)))
            files.append(source)
        else:
            raise UserError(f"{source}: no such file or directory")
    if not files:
        raise UserError(f"no *.json or *.jsonl files in {', '.join(map(str, sources))}")
    base = os.path.commonpath(bases)
    found = {Path(os.path.relpath(os.path.abspath(p), base)).as_posix(): Path(p) for p in files}
    return dict(sorted(found.items()))


def file_stem(rel: str) -> str:
    """The shard and key prefix of an input file: readable, and unique by its hash. Never
    starts with ``_`` or ``.`` (names the index takes for no shard) and holds no dot (the key
    ends at the first one)."""
    readable = re.sub(r"[^A-Za-z0-9_-]+", "_", rel.rsplit(".", 1)[0])[-40:].lstrip("_-")
    return f"{readable or 'input'}-{hashlib.sha1(rel.encode()).hexdigest()[:8]}"


class Manifest:
    """``OUT/_import.json``: the settings, and per converted input file its fingerprint,
    shards, sample count and skipped records. Its shards exist whenever it lists them."""

    def __init__(self, out: Path, settings: dict, files: dict[str, dict]) -> None:
        self.out, self.settings, self.files = out, settings, files
        self._written = 0.0

    @classmethod
    def open(cls, out: Path, settings: dict, force: bool) -> Manifest:
        """The manifest of ``out``, whose entries :meth:`keep` then checks against the input
        files; an empty one for a new ``out`` or with ``force`` (which removes every shard
        there). Leftover temporary shards of an interrupted run are removed."""
        path = out / MANIFEST
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out}: not a directory")
        old = None
        if path.is_file():
            try:
                old = json.loads(path.read_text(encoding="utf-8"))
                dict(old["files"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                if not force:
                    raise UserError(f"{path}: unreadable import manifest; --force starts "
                                    "over") from None
                old = None
        elif out.is_dir() and any(out.iterdir()):
            raise UserError(f"--out {out}: not empty, and not an import's output (no "
                            f"{MANIFEST}); name a new or empty directory")
        same = old is not None and old.get("version") == MANIFEST_VERSION \
            and old.get("settings") == settings
        if old is not None and not same and not force:
            theirs = old.get("settings", {})
            diff = ", ".join(f"{k} {theirs.get(k)!r}" for k in settings
                             if theirs.get(k) != settings[k]) or f"version {old.get('version')}"
            raise UserError(f"--out {out}: holds an import made with {diff}; rerun it with "
                            "the same arguments to resume it, or --force to start over")
        out.mkdir(parents=True, exist_ok=True)
        for leftover in out.glob(".*.part"):
            leftover.unlink()
        if force:
            for shard in out.glob("*.tar"):
                shard.unlink()
        return cls(out, settings, dict(old["files"]) if same and not force else {})

    def keep(self, fingerprints: dict[str, dict]) -> None:
        """Keep the entries of input files that are there unchanged with all their shards;
        remove the shards of every other entry, and write the manifest."""
        kept = {}
        for rel, entry in self.files.items():
            if not _well_formed(entry):
                continue
            same = fingerprints.get(rel) == {k: entry[k] for k in ("size", "mtime_ns")}
            if same and all((self.out / s).is_file() for s in entry["shards"]):
                kept[rel] = entry
            else:
                self._drop(entry)
        self.files = kept
        self.write(order=list(fingerprints))

    def add(self, result: FileResult, fingerprint: dict) -> None:
        self.files[result.rel] = {**fingerprint, "shards": result.shards,
                                  "samples": result.samples, "skipped": result.skipped}
        if time.monotonic() - self._written >= MANIFEST_EVERY_S:
            self.write()

    def write(self, order: list[str] | None = None) -> None:
        if order is not None:  # input order, whatever order the files finished in
            self.files = {rel: self.files[rel] for rel in order if rel in self.files}
        body = {"version": MANIFEST_VERSION, "settings": self.settings, "files": self.files}
        _write_atomically(self.out / MANIFEST, json.dumps(body, ensure_ascii=False, indent=1))
        self._written = time.monotonic()

    def _drop(self, entry: dict) -> None:
        for shard in entry.get("shards", []):
            (self.out / shard).unlink(missing_ok=True)


def _run(tasks: list[FileTask], workers: int | None, progress: bool, fmt: str,
         total_bytes: int):
    """Yield each task's result as it finishes: in worker processes when more than one file
    is worth it, with a progress bar over the input bytes."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TextColumn("{task.fields[files]}"), TimeRemainingColumn(), console=console,
                   transient=True, disable=not (progress and console.is_terminal))
    workers = min(workers or os.cpu_count() or 1, len(tasks))
    with bar:
        task = bar.add_task(f"importing {fmt}", total=total_bytes,
                            files=f"0/{len(tasks)} files")
        done = 0

        def finished(result: FileResult) -> FileResult:
            nonlocal done
            done += 1
            bar.update(task, files=f"{done}/{len(tasks)} files")
            return result

        if workers <= 1:
            for t in tasks:
                yield finished(convert_file(t, lambda n: bar.advance(task, n)))
            return
        # spawn, as `data index` does: a fork would copy whatever threads the caller runs.
        context = multiprocessing.get_context("spawn")
        queue = context.Queue() if not bar.disable else None
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_set_progress,
                                 initargs=(queue,)) as pool:
            # No more files in flight than workers: on ^C (which the workers get too) every
            # started file stops at once and none is left queued to run to its end.
            waiting = iter(tasks)
            pending = {pool.submit(_convert_reporting, t) for t in islice(waiting, workers)}
            while pending:
                ready, pending = wait(pending, timeout=0.2 if queue else None,
                                      return_when=FIRST_COMPLETED)
                while queue is not None and not queue.empty():
                    bar.advance(task, queue.get())
                for future in ready:
                    pending |= {pool.submit(_convert_reporting, t) for t in islice(waiting, 1)}
                    yield finished(future.result())


_PROGRESS = None  # a worker process's queue for progress, set by the pool's initializer


def _set_progress(queue) -> None:
    global _PROGRESS
    _PROGRESS = queue


def _convert_reporting(task: FileTask) -> FileResult:
    return convert_file(task, _PROGRESS.put if _PROGRESS is not None else None)


def _well_formed(entry: object) -> bool:
    """A manifest entry as :meth:`Manifest.add` writes it (one edited by hand may not be)."""
    return isinstance(entry, dict) and all(k in entry for k in ENTRY_KEYS) \
        and isinstance(entry["shards"], list) and isinstance(entry["skipped"], list) \
        and all(isinstance(s, str) and "/" not in s for s in entry["shards"])


def _fingerprint(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _shown(path: Path | str) -> str:
    from omniscale.loaders.index import shown

    return shown(Path(path))
