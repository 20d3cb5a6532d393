"""``omniscale data demo``: the demo omni dataset, end to end.

:func:`generate` resolves a scale to a :class:`Plan`, builds the dataset in a temporary
directory next to ``OUT`` and renames it into place, so a crash never leaves a half dataset that
looks complete. :func:`build` does the work for any plan; tests call it with a few samples per
source.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from omniscale.errors import UserError
from omniscale.tools.demo import specs, text
from omniscale.tools.demo.shards import SOURCE_IDS, SPLIT_IDS, ShardResult, ShardTask, write_shard
from omniscale.tools.demo.tokenizer import VOCAB_SIZE, train_tokenizer

VERSION = 3  # 2: lm.yaml and video.yaml, the lm and video_gen tasks' specs; 3: chat, sft*.yaml
SUMMARY_FILE = "demo.json"
SPEC_FILES = {"train": "mix.yaml", "eval": "eval.yaml"}
TASK_SPECS = {"lm": ("lm.yaml", ("text", "docs")),
              "video": ("video.yaml", ("video_caption",)),
              "sft": ("sft.yaml", ("chat",))}
# The fine-tuning demo's held-out conversations (configs/demo_sft.yaml).
EVAL_TASK_SPECS = {"sft_eval": ("sft_eval.yaml", ("chat",))}
# Sources only task specs draw from: the main mixture and its eval set leave them out.
TASK_ONLY = ("chat",)
# name -> (format, template), in the order the specs list them.
SOURCES = {
    "text": ("webdataset", "text"), "docs": ("parquet", "text"),
    "image_caption": ("webdataset", "image_caption"),
    "video_caption": ("webdataset", "video_caption"),
    "audio_caption": ("webdataset", "audio_caption"),
    "interleaved": ("webdataset", "interleaved"),
    "chat": ("webdataset", "conversation"),
}
# Samples per (split, source) at tiny; ``text`` counts stdlib files (big ones add parts).
TINY_COUNTS = {
    ("train", "text"): 64, ("train", "image_caption"): 128, ("train", "video_caption"): 64,
    ("train", "audio_caption"): 64, ("train", "interleaved"): 64,
    ("eval", "text"): 16, ("eval", "image_caption"): 32, ("eval", "video_caption"): 32,
    ("eval", "audio_caption"): 32,
    ("train", "chat"): 128, ("eval", "chat"): 48,
}
SCALES = {  # scale -> (multiple of tiny, samples per tar shard by split)
    "tiny": (1, {"train": 32, "eval": 16}),
    "small": (5, {"train": 64, "eval": 32}),
    "medium": (25, {"train": 128, "eval": 64}),
}
# Slowest sources first, so the pool's tail is short.
COST_ORDER = ("video_caption", "audio_caption", "chat", "image_caption", "interleaved", "text",
              "docs")


@dataclass(frozen=True)
class Plan:
    """How much to generate: ``counts[(split, source)]`` samples (files for ``text``), cut
    into shards of about ``shard_size[split]``. ``docs`` is always train and holds every
    pydoc topic, in ``docs_files`` Parquet files of ``docs_row_group`` rows per row group."""

    counts: dict[tuple[str, str], int]
    shard_size: dict[str, int]
    docs_files: int = 2
    docs_row_group: int = 8


def scale_plan(scale: str) -> Plan:
    if scale not in SCALES:
        raise UserError(f"unknown demo scale {scale!r}: choose one of {', '.join(SCALES)}")
    multiple, shard_size = SCALES[scale]
    return Plan({k: n * multiple for k, n in TINY_COUNTS.items()}, dict(shard_size))


def _ranges(n: int, shard_size: int) -> list[tuple[int, int]]:
    """(start, count) per shard: at least two shards when there are two samples, even sizes."""
    k = max(min(2, n), -(-n // shard_size))
    return [(j * n // k, (j + 1) * n // k - j * n // k) for j in range(k)]


def plan_tasks(dest: Path, plan: Plan, seed: int) -> tuple[list[ShardTask], list[str]]:
    """Every shard task of the plan (slowest sources first), and the training text the
    tokenizer learns from. ``docs`` always goes to train with every pydoc topic."""
    text_counts = {s: plan.counts[(s, "text")] for s in ("eval", "train")
                   if (s, "text") in plan.counts}  # eval first: its files do not move with train
    files = text.choose_files(seed, SOURCE_IDS["text"], text_counts)
    docs = text.topics()
    tasks: list[ShardTask] = []
    # docs first: the tokenizer keeps a bounded prefix, and every topic should be in it.
    train_text = [t for _, t in docs]

    def add(split: str, source: str, n: int, shard_size: int, rows: list, ext: str) -> None:
        folder = dest / split / source
        folder.mkdir(parents=True, exist_ok=True)
        for j, (start, count) in enumerate(_ranges(n, shard_size)):
            tasks.append(ShardTask(source, split, j, start, count,
                                   folder / f"{source}-{j:06d}.{ext}", seed,
                                   tuple(rows[start:start + count]), plan.docs_row_group))

    for (split, source), n in plan.counts.items():
        if source == "text":
            rows = text.text_samples(files[split])
            train_text += [t for t, _ in rows] if split == "train" else []
            add(split, source, len(rows), plan.shard_size[split], rows, "tar")
        else:
            add(split, source, n, plan.shard_size[split], [], "tar")
    add("train", "docs", len(docs), -(-len(docs) // plan.docs_files), docs, "parquet")
    tasks.sort(key=lambda t: (COST_ORDER.index(t.source), t.split, t.index))
    return tasks, train_text


def _run(tasks: list[ShardTask], workers: int, progress: bool) -> list[ShardResult]:
    """Write every shard, in a process pool when ``workers > 1``; results in task order."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("samples"), TimeElapsedColumn(), TextColumn("eta"),
               TimeRemainingColumn())
    results: dict[int, ShardResult] = {}
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        job = bar.add_task("demo data", total=sum(t.count for t in tasks))
        if workers <= 1:
            for i, task in enumerate(tasks):
                results[i] = write_shard(task)
                bar.advance(job, task.count)
        else:
            # spawn, not fork: the progress bar runs a refresh thread in this process.
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
                futures = {pool.submit(write_shard, t): i for i, t in enumerate(tasks)}
                for future in as_completed(futures):
                    i = futures[future]
                    results[i] = future.result()
                    bar.advance(job, tasks[i].count)
    return [results[i] for i in range(len(tasks))]


def build(dest: Path, plan: Plan, seed: int = 0, workers: int = 1, progress: bool = False,
          scale: str = "custom", vocab_size: int = VOCAB_SIZE) -> dict:
    """Write the whole dataset of ``plan`` into the existing directory ``dest``; returns the
    summary, also written to ``dest/demo.json`` last. Output bytes depend only on (plan, seed,
    vocab_size).
    """
    tasks, train_text = plan_tasks(dest, plan, seed)
    results = _run(tasks, workers, progress)
    captions = [c for r in sorted(results, key=lambda r: (r.split, r.source, r.index))
                for c in r.captions]
    train_tokenizer(train_text, captions, dest / "tokenizer.json", vocab_size=vocab_size)

    sources: dict[str, dict[str, dict]] = {}
    for task, result in sorted(zip(tasks, results),
                               key=lambda tr: (SPLIT_IDS[tr[0].split], tr[0].index)):
        fmt, template = SOURCES[task.source]
        entry = sources.setdefault(task.split, {}).setdefault(
            task.source, {"format": fmt, "template": template, "samples": 0, "shards": 0,
                          "bytes": 0, "files": {}})
        entry["samples"] += result.samples
        entry["shards"] += 1
        entry["bytes"] += result.bytes
        entry["files"][task.path.relative_to(dest).as_posix()] = result.bytes
    for split in sources:
        sources[split] = {name: sources[split][name] for name in SOURCES if name in sources[split]}
    in_split = {split: {n: SOURCES[n] for n in entries} for split, entries in sources.items()}
    main = {split: {n: v for n, v in entries.items() if n not in TASK_ONLY}
            for split, entries in in_split.items()}
    specs.write_spec(dest / SPEC_FILES["train"], specs.mix_spec(seed, main["train"]),
                     f"Demo training mixture (omniscale data demo, scale {scale}, seed {seed}).\n"
                     "Curriculum: text-heavy warm-up, then every modality ramps in.")
    if "eval" in in_split:
        specs.write_spec(dest / SPEC_FILES["eval"], specs.eval_spec(seed, main["eval"]),
                         f"Demo held-out evaluation set (scale {scale}, seed {seed}): "
                         "disjoint from train.")
    spec_files = {split: SPEC_FILES[split] for split in sources}
    for task, (name, wanted) in TASK_SPECS.items():
        chosen = {n: v for n, v in in_split["train"].items() if n in wanted}
        if chosen:
            specs.write_spec(dest / name, specs.task_spec(seed, chosen),
                             f"Demo {task} mixture (scale {scale}, seed {seed}): "
                             f"{', '.join(chosen)} at constant weight.")
            spec_files[task] = name
    for task, (name, wanted) in EVAL_TASK_SPECS.items():
        chosen = {n: v for n, v in in_split.get("eval", {}).items() if n in wanted}
        if chosen:
            specs.write_spec(dest / name, specs.eval_spec(seed, chosen),
                             f"Demo {task} held-out set (scale {scale}, seed {seed}).")
            spec_files[task] = name
    summary = {"version": VERSION, "scale": scale, "seed": seed, "tokenizer": "tokenizer.json",
               "vocab_size": vocab_size, "specs": spec_files, "sources": sources}
    (dest / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _complete_demo(out: Path) -> dict | None:
    """The summary of the demo in ``out`` if every file it lists is there at its size.

    Raises UserError when ``out`` holds something that is not a demo: we never replace it.
    """
    if not out.exists():
        return None
    if not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory")
    try:
        summary = json.loads((out / SUMMARY_FILE).read_text())
    except FileNotFoundError:
        if any(out.iterdir()):
            raise UserError(f"{out}: exists, is not empty and holds no {SUMMARY_FILE}; "
                            "refusing to replace it (choose a new or empty directory)") from None
        return None
    except (OSError, ValueError):
        return None  # a damaged demo of ours: regenerate it
    listed = [f for split in summary.get("sources", {}).values() for entry in split.values()
              for f in entry.get("files", {}).items()]
    listed += [(name, None) for name in ("tokenizer.json", *summary.get("specs", {}).values())]
    for name, size in listed:
        path = out / name
        if not path.is_file() or (size is not None and path.stat().st_size != size):
            return None
    return summary


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``, replacing a previous demo (or empty directory)."""
    tmp.chmod(0o755)  # mkdtemp makes it private
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old)


def _print_summary(summary: dict, out: Path, seconds: float | None) -> None:
    table = Table(title=f"demo data ({summary['scale']}, seed {summary['seed']}) in {out}")
    for column in ("split", "source", "format", "template"):
        table.add_column(column)
    for column in ("samples", "shards", "MB"):
        table.add_column(column, justify="right")
    for split, entries in summary["sources"].items():
        for name, e in entries.items():
            table.add_row(split, name, e["format"], e["template"], str(e["samples"]),
                          str(e["shards"]), f"{e['bytes'] / 1e6:.1f}")
    console = Console()
    console.print(table)
    console.print("already complete, nothing to do" if seconds is None
                  else f"generated in {seconds:.1f} s")


def generate(out: Path, scale: str = "tiny", seed: int = 0, workers: int | None = None,
             progress: bool = True, vocab_size: int = VOCAB_SIZE) -> dict:
    """Generate the demo dataset of ``scale`` and ``seed`` into ``out``; returns its summary
    (also in ``out/demo.json``). Returns at once when ``out`` already holds that demo.

    The result is byte-identical for the same (scale, seed, vocab_size), whatever ``workers``
    is. ``progress`` shows a progress bar and a summary table. ``vocab_size``: the tokenizer's
    (the test suite's demo takes a smaller one: on a CPU the LM head over the vocabulary is
    most of a tiny model's training step).
    """
    plan = scale_plan(scale)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError(f"demo seed {seed!r}: must be an integer >= 0")
    if workers is not None and workers < 1:
        raise UserError(f"demo workers {workers}: must be >= 1")
    out = Path(out)
    existing = _complete_demo(out)
    if existing and (existing.get("version"), existing.get("scale"), existing.get("seed"),
                     existing.get("vocab_size", VOCAB_SIZE)) == (VERSION, scale, seed, vocab_size):
        if progress:
            _print_summary(existing, out, None)
        return existing
    workers = workers or len(os.sched_getaffinity(0))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    t0 = time.perf_counter()
    try:
        summary = build(tmp, plan, seed, workers, progress, scale, vocab_size)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        _print_summary(summary, out, time.perf_counter() - t0)
    return summary
