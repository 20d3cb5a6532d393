"""The plane benchmark's measured peer for loader memory: Megatron-Energon's DataLoader workers
holding the same sources, as its users run it.

The plane bench's first baseline is our own catalog copied into every process; this one is a
peer loader. The same number of sources and shards as the plane's synthetic indexes is written
as real tar shards (one tiny text member per sample), ``energon prepare``-d once
(``loader_energon.prepare``, reused while the tars stay), and blended at equal weight by a
``MetadatasetV2`` (every source in one blend, as a job mixing them trains). One rank's loader
(``get_train_dataset`` + ``get_loader``, ``WorkerConfig(rank=0, world_size=1,
num_workers=W)``, the loader bench's settings: no shuffle buffer, whole shard slices) runs
until each worker has drawn about ``DRAWS_PER_SOURCE`` samples of every source, so every
source's reader state is open in every worker; then the PSS of the rank's main process and of
each worker is read from /proc. W = 1, 2, 4, 8 (the plane bench's ``--memory-procs``), and a
least-squares line over W gives what a worker costs; the same runs over one source give what a
worker costs with no sources' state (the "bare" line of the state-only figure).

Energon keeps no per-sample state in a worker: it reads sample offsets from each shard's
``.tar.idx`` when it opens the shard. Its memory therefore depends on sources and shards, not
on samples per shard, so the tars hold ``PER_SHARD`` samples each, not the plane's 1,000. The
bench checks that claim in every default run: ``per_shard_check`` measures W workers over the
first ``CHECK_SOURCES`` sources at ``PER_SHARD`` and at the plane's samples per shard.

What is counted: what the W workers add to the rank's total PSS (main + workers: the slope of
the line over W, times the job's loader processes), not the rank's main process, which is the
trainer itself and also holds the dataset object -- a choice in Energon's favour, stated with
the figure. Ours counts the plane and the trainer-side client processes, not the trainers
either.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

PER_SHARD = 10  # samples per tar shard (Energon's worker memory does not depend on it)
DRAWS_PER_SOURCE = 10  # samples each worker draws of each source before it is measured
CHECK_SOURCES = 100  # sources of the samples-per-shard check


def write_tar_sources(root: Path, names: list[str], shards: int, per_shard: int) -> None:
    """``shards`` tar shards of ``per_shard`` one-member text samples per source (kept when
    already there)."""
    for s, name in enumerate(names):
        source = root / name
        source.mkdir(parents=True, exist_ok=True)
        for h in range(shards):
            path = source / f"{name}-{h:06d}.tar"
            if path.is_file():
                continue
            part = path.with_suffix(".tar.part")
            with tarfile.open(part, "w") as tar:
                for j in range(per_shard):
                    data = f"source {s} shard {h} sample {j}".encode()
                    info = tarfile.TarInfo(f"{name}-{h:06d}-{j:06d}.txt")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
            part.rename(path)


def prepared_sources(root: Path, sources: int, shards: int, per_shard: int) -> Path:
    """``root/SxHxP``: ``sources`` tar sources written and ``energon prepare``-d (both kept)."""
    from omniscale.tools.bench.loader_energon import prepare

    where = root / f"energon-{sources}x{shards}x{per_shard}"
    names = [f"src-{i:04d}" for i in range(sources)]
    write_tar_sources(where, names, shards, per_shard)
    prepare(SimpleNamespace(sources=[SimpleNamespace(name=n, path=str(where / n))
                                     for n in names]))
    return where


def pss_bytes(pid: int) -> int:
    """Proportional set size: pages shared with other processes counted by their share."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Pss")


def _children(pid: int) -> list[int]:
    """The process's child PIDs (its DataLoader workers), from /proc."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def loader_role(root: str, sources: int, workers: int) -> None:
    """One rank's Energon loader over the first ``sources`` sources under ``root`` with
    ``workers`` workers, drawn from until every worker has opened every source; prints the
    PSS of the main process and of each worker as JSON."""
    import yaml
    from megatron.energon import (
        Cooker,
        Sample,
        TaskEncoder,
        WorkerConfig,
        basic_sample_keys,
        edataclass,
        get_loader,
        get_train_dataset,
        stateless,
    )

    @edataclass
    class Text(Sample):
        text: bytes

    class Encoder(TaskEncoder):
        decoder = None  # the raw member: nothing to decode, state is what is measured

        def __init__(self) -> None:
            self.cookers = (Cooker(self.cook),)

        @stateless
        def cook(self, crude: dict) -> Text:
            return Text(**basic_sample_keys(crude), text=crude["txt"])

        @stateless
        def batch(self, samples: list[Text]) -> list[str]:
            return [s.__subflavors__["source"] for s in samples]

    paths = sorted(p for p in Path(root).iterdir() if p.is_dir())[:sources]
    blend = [{"weight": 1.0, "path": str(p), "subflavors": {"source": p.name}} for p in paths]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mds = Path(tmp) / "blend.yaml"
        mds.write_text(yaml.safe_dump({"__module__": "megatron.energon",
                                       "__class__": "MetadatasetV2",
                                       "splits": {"train": {"blend": blend}}}))
        dataset = get_train_dataset(
            mds, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
            batch_size=16, shuffle_buffer_size=None, max_samples_per_sequence=None,
            parallel_shard_iters=1, task_encoder=Encoder())
    with warnings.catch_warnings():  # its loader always asks for pinned memory; none on CPU
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true")
        batches = iter(get_loader(dataset, prefetch_factor=4, watchdog_timeout_seconds=None))
    drawn, want, seen = 0, len(paths) * DRAWS_PER_SOURCE * workers, set()
    while drawn < want:
        names = next(batches)
        drawn += len(names)
        seen.update(names)
    kids = _children(os.getpid())
    print(json.dumps({"workers": workers, "sources": len(paths), "drawn": drawn,
                      "sources_drawn": len(seen),
                      "main_bytes": pss_bytes(os.getpid()),
                      "worker_bytes": [pss_bytes(k) for k in kids],
                      "seconds": time.perf_counter() - start}), flush=True)
    for kid in kids:  # now: an orphaned worker notices its parent gone only after 5 s
        os.kill(kid, signal.SIGKILL)
    os._exit(0)


def _measure(root: Path, sources: int, workers: int) -> dict:
    import subprocess

    role = ("import sys\nfrom omniscale.tools.bench.plane_energon import loader_role\n"
            "loader_role(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))\n")
    done = subprocess.run([sys.executable, "-c", role, str(root), str(sources), str(workers)],
                          capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"energon loader ({sources} sources, {workers} workers) failed:\n"
                           f"{done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if len(out["worker_bytes"]) != workers:
        raise RuntimeError(f"energon loader: {len(out['worker_bytes'])} worker processes "
                           f"found, {workers} asked")
    return out


def energon_memory(data: Path, sources: int, shards: int, procs: tuple[int, ...],
                   fit, processes: int, check_per_shard: int | None = None) -> dict:
    """Energon's loader workers over ``sources`` x ``shards`` (real tars under ``data``) at
    each worker count in ``procs``, over all sources and over one; ``fit`` (the plane bench's
    least-squares line) extrapolates the workers' PSS to ``processes``. With
    ``check_per_shard``: the samples-per-shard check at the largest worker count."""
    root = prepared_sources(data, sources, shards, PER_SHARD)
    runs = {n: {w: _measure(root, n, w) for w in procs} for n in (sources, 1)}

    def line(n: int) -> dict:  # the rank's total over W: its slope is what a worker adds
        points = {w: r["main_bytes"] + sum(r["worker_bytes"]) for w, r in runs[n].items()}
        out = fit(points, processes)
        out["workers_bytes"] = out["bytes_per_process"] * processes  # the main left out
        return out

    out = {"method": f"PSS of one rank's Energon loader (main process + W DataLoader workers) "
                     f"at W = {', '.join(map(str, procs))}, least-squares line over W; what "
                     f"{processes} workers add (the slope times {processes}; the ranks' main "
                     "processes, which are the trainers, not counted)",
           "sources": sources, "shards": shards, "per_shard": PER_SHARD,
           "draws_per_source_per_worker": DRAWS_PER_SOURCE,
           "workers": line(sources), "bare": line(1),
           "main_bytes": {str(w): r["main_bytes"] for w, r in runs[sources].items()},
           "sources_drawn": min(r["sources_drawn"] for r in runs[sources].values()),
           "seconds": sum(r["seconds"] for n in runs for r in runs[n].values())}
    if check_per_shard:
        w, n = max(procs), min(CHECK_SOURCES, sources)
        per = {p: sum(_measure(prepared_sources(data, n, shards, p), n, w)["worker_bytes"]) / w
               for p in (PER_SHARD, check_per_shard)}
        out["per_shard_check"] = {
            "sources": n, "workers": w,
            "bytes_per_worker": {str(p): b for p, b in per.items()},
            "growth": per[check_per_shard] / per[PER_SHARD] - 1}
    return out
