"""Loader benchmark: throughput against DataLoader + webdataset and Megatron-Energon, memory
per worker.

    .venv/bin/python tools/bench/loader.py [--steps 40] [--workers 2] [--rounds 6]
        [--workloads mixed image video text] [--out docs/bench/loader.json]

Throughput, per workload. The tiny demo (generated under --data unless there, indexed), its
webdataset sources from step 0 (Parquet ``docs`` left out: the baselines cannot read it): all
of them mixed, or the image, video or text source alone (the text workload runs 20 times the
steps: its steps take a fraction of a millisecond each). Ours: an embedded plane
(dp 1) and a RankLoader with ``--workers`` DataLoader workers, every step committed. Two
baselines, each with the same number of workers, the same decoders
(``SampleDecoder.decode_raw``) and the same packing (``collate``, one batch per ``--pack``
samples, packed in the workers: a worker hands over one batch of tensors per ``--pack``
samples, their best transfer), for the same number of samples, mixing the sources in the
proportions ours drew:

- webdataset: a ``torch.utils.data.DataLoader`` over a ``webdataset`` pipeline per source
  (shards split by worker, sources mixed by ``RandomMix``), packed as its ``batched`` stage does;
- Megatron-Energon (``loader_energon.py``: each source ``energon prepare``-d, blended by a
  metadataset, decoded in a cooker, batched by its task encoder).

Samples/s and LLM tokens/s of each. The three alternate over ``--rounds`` rounds, the order
rotating each round; the headline is the median of the per-round ratios of ours to the
faster baseline of that round, with their minimum and maximum; the ratios to each baseline
alone are reported too.

Memory per worker. A fresh process plays one worker holding N sources (10, 100, 1,000), each
its own directory (the demo's image source, its files linked into N distinct directories, so
nothing keyed by path is shared): ours decodes one sample of each source through one SampleReader
(bounded LRU of open shards); the baseline opens one webdataset pipeline per source and takes
a sample from each (what a per-source pipeline in every worker holds). RSS growth over the
process before it, per N.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from omniscale.tools.bench.provenance import provenance  # noqa: E402

TAR_SOURCES = ("text", "image_caption", "video_caption", "audio_caption", "interleaved")


WORKLOADS = {  # source weights of each workload (webdataset reads only the tar sources)
    "mixed": {s: 1 for s in TAR_SOURCES} | {"text": 0.25},
    "image": {"image_caption": 1},
    "video": {"video_caption": 1},
    "text": {"text": 1},
}
# The targets, ours over the baseline in samples/s (none set for video alone).
TARGETS = {"mixed": 1.5, "image": 1.5, "text": 3.0}
# Steps per workload, as a multiple of --steps: a step of long documents takes a fraction of
# a millisecond to load, so the text workload runs more of them to time something.
STEP_FACTOR = {"text": 20}


def demo_spec(data: Path, workload: str = "mixed", scale: str = "tiny") -> Path:
    """The demo under ``data`` (generated and indexed once) and a spec mixing its tar
    sources from step 0 in the workload's proportions."""
    import yaml

    from omniscale.loaders.index import index_paths
    from omniscale.tools.demo import generate

    demo = data / ("demo" if scale == "tiny" else f"demo-{scale}")
    if not (demo / "mix.yaml").is_file():
        generate(demo, scale=scale, seed=3, progress=False)
    index_paths([demo / "mix.yaml"], progress=False)  # incremental: re-indexes what changed
    spec = yaml.safe_load((demo / "mix.yaml").read_text())
    spec["sources"] = [s for s in spec["sources"] if s["name"] in TAR_SOURCES]
    weights = {s: WORKLOADS[workload].get(s, 0) for s in TAR_SOURCES}
    spec["schedule"] = {"unit": "steps", "segments": [{"kind": "const", "start": 0, "end": None,
                        "weights": weights}]}
    path = demo / f"bench-{workload}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_ours(spec_path: Path, steps: int, workers: int, make_loader=None) -> dict:
    """``steps`` steps through our loader on an embedded plane: a ``RankLoader`` with
    ``workers`` DataLoader workers, or ``make_loader(url, spec)``'s. Its start (construction
    and first step) is timed apart from the throughput."""
    from omniscale.dataplane.embedded import start_embedded
    from omniscale.dataplane.plane import PlaneConfig
    from omniscale.dataplane.spec import load_spec
    from omniscale.loaders.pipeline import RankLoader
    from omniscale.loaders.remote_io import add_stats
    from omniscale.tools.train.plane_session import loader_for

    spec = load_spec(spec_path)
    config = PlaneConfig(dp=1, micro_batch_tokens=16384, window=4, global_batch_tokens=16384,
                         sp_max=1, snapshot_every=1000)
    per_source: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as state, start_embedded(spec_path, state, config) as p:
        started = time.perf_counter()
        loader = make_loader(p.url, spec) if make_loader else loader_for(
            p.url, 0, RankLoader, {s.name: s.path for s in spec.sources}, spec.tokenizer,
            spec.media, num_workers=workers, prefetch_steps=2)
        with loader:
            first = next(loader)  # worker start-up is not throughput
            loader.commit(first.step)
            start_s = time.perf_counter() - started
            start = time.perf_counter()
            samples = tokens = moved = 0
            io: dict[str, int] = {}  # the measured steps' own reads (read-ahead past them not)
            for _ in range(steps):
                batch = next(loader)
                samples += batch.num_samples
                tokens += batch.num_tokens
                moved += batch.transfer_bytes
                add_stats(io, batch.io)
                loader.commit(batch.step)
            seconds = time.perf_counter() - start
            wait = loader.data_wait_s
            pools = loader.pool_stats()["actors"] if hasattr(loader, "pool_stats") else None
        with_counts = p.plane.status()["sources"]
    epochs = {}
    for row in with_counts:
        per_source[row["source"]] = row["served_samples"]
        epochs[row["source"]] = row.get("epoch")
    return {"samples": samples, "tokens": tokens, "seconds": seconds,
            "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
            "data_wait_s": wait, "drawn_per_source": per_source, "epochs": epochs,
            "bytes_per_sample": moved / max(samples, 1), "start_s": start_s, "io": io,
            **({"actors": pools} if pools is not None else {})}


def run_baseline(spec_path: Path, samples: int, workers: int, weights: dict[str, float],
                 pack: int) -> dict:
    import torch

    from omniscale.dataplane.spec import load_spec

    spec = load_spec(spec_path)
    dataset = _MixedWebDataset(spec, weights, pack)
    collect_before_fork()
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers,
                                         collate_fn=lambda x: x, prefetch_factor=4)
    it = iter(loader)
    out = time_batches(it, samples)
    del it
    return out


def collect_before_fork() -> None:
    """Free this process's garbage before a baseline forks its workers: our run before it
    leaves its embedded plane's Flight server to the collector, and a forked worker that
    collects it blocks forever on a gRPC lock whose thread it lacks (seen: a webdataset
    worker hung in ``~FlightServerBase``). Our loader does the same before it forks
    (``loaders.worker_pool.WorkerPool``)."""
    import gc

    gc.collect()


def time_batches(it, samples: int) -> dict:
    """A baseline's throughput: its first batch (worker start-up) untimed, then PackedBatches
    from ``it`` until ``samples`` samples; the bytes handed over are the batches' tensors."""
    next(it)
    start = time.perf_counter()
    n = tokens = moved = 0
    while n < samples:
        batch = next(it)
        n += int(batch.cu_seqlens_S1.numel()) - 1
        tokens += batch.num_tokens
        moved += sum(t.numel() * t.element_size() for t in vars(batch).values()
                     if isinstance(t, torch.Tensor))
    seconds = time.perf_counter() - start
    return {"samples": n, "tokens": tokens, "seconds": seconds,
            "samples_per_s": n / seconds, "tokens_per_s": tokens / seconds,
            "bytes_per_sample": moved / max(n, 1)}


class _MixedWebDataset(torch.utils.data.IterableDataset):
    """An IterableDataset: one webdataset pipeline per source, mixed by weight, decoded with
    our decoders and packed ``pack`` samples to a batch. Built lazily in each worker (shards
    split by worker)."""

    def __init__(self, spec, weights: dict[str, float], pack: int) -> None:
        self.spec, self.weights, self.pack = spec, weights, pack

    def __iter__(self):
        from omniscale.loaders.collate import collate

        chunk = []
        for sample in self._samples():
            chunk.append((sample, 1, 0))
            if len(chunk) == self.pack:
                yield collate(chunk, self.spec.media)
                chunk = []

    def _samples(self):
        import webdataset as wds

        from omniscale.loaders.decode import SampleDecoder
        from omniscale.loaders.readers import RawSample, SampleReader
        from omniscale.refs import SampleRef

        decoder = SampleDecoder(SampleReader({}), self.spec.tokenizer, self.spec.media)
        pipes, probs = [], []
        for s in self.spec.sources:
            shards = sorted(str(p) for p in Path(s.path).glob("*.tar"))
            pipe = wds.DataPipeline(wds.SimpleShardList(shards), wds.split_by_worker,
                                    wds.tarfile_to_samples())
            pipes.append(_forever(pipe, s.name))
            probs.append(self.weights.get(s.name, 0.0) + 1e-9)
        for name, raw in wds.RandomMix(pipes, probs, longest=True):
            key = raw["__key__"]
            members = tuple((f"{key}.{k}", v) for k, v in raw.items() if not k.startswith("__"))
            ref = SampleRef(0, name, "", key, 0, 0)
            try:
                yield decoder.decode_raw(ref, RawSample(name, key, members))
            except Exception:  # noqa: BLE001 -- the baseline skips what it cannot decode
                continue


def _forever(pipe, name: str):
    """Cycle a source's shards (epochs), tagging samples with the source name."""
    while True:
        for raw in pipe:
            yield name, raw


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


MEMORY_CHILD = r"""
import json, sys, gc
sys.path.insert(0, {root!r})
from omniscale.tools.bench.loader import rss_kib, memory_child
print(json.dumps(memory_child({kind!r}, {n}, {path!r}, {tokenizer!r}, {media!r})))
"""


def memory_child(kind: str, n: int, path: str, tokenizer: str, media: dict) -> dict:
    """Run in a fresh process: RSS growth of one worker holding ``n`` sources, source ``i``
    being the directory ``path/src{i:04d}``."""
    import torch  # noqa: F401 -- in both baselines before the measurement starts
    import webdataset as wds

    from omniscale.geometry import MediaGeometry
    from omniscale.loaders.ray_loaders import probe_refs
    from omniscale.loaders.worker import TimedDecoder, decoder_spec

    names = [f"src{i:04d}" for i in range(n)]
    dirs = {s: str(Path(path) / s) for s in names}
    ref = probe_refs("image", dirs[names[0]], 1)[0]
    before = rss_kib()
    held = []
    if kind == "ours":
        decoder = TimedDecoder(decoder_spec(dirs, tokenizer, MediaGeometry(**media)),
                               timeout=None)
        import dataclasses
        for s in names:
            out = decoder.decode(dataclasses.replace(ref, source=s))
            assert out.error is None, out.error
        held.append(decoder)
    else:
        for s in names:
            shards = sorted(str(p) for p in Path(dirs[s]).glob("*.tar"))
            pipe = iter(wds.WebDataset(shards, shardshuffle=False, empty_check=False))
            next(pipe)  # the pipeline is open on its first shard, as in a running worker
            held.append(pipe)
    return {"kind": kind, "sources": n, "rss_growth_mib": (rss_kib() - before) / 1024}


def source_copies(source: Path, root: Path, n: int) -> Path:
    """``root/src0000`` … ``root/src{n-1}``: each a directory of hard links (or symlinks) to
    ``source``'s files -- N distinct sources on disk without N copies of the bytes."""
    for i in range(n):
        d = root / f"src{i:04d}"
        if d.is_dir():
            continue
        d.mkdir(parents=True)
        for f in source.iterdir():
            if f.is_file():
                try:
                    os.link(f, d / f.name)
                except OSError:
                    os.symlink(f.resolve(), d / f.name)
    return root


def memory(spec_path: Path, counts: list[int], data: Path) -> list[dict]:
    from omniscale.dataplane.spec import load_spec

    spec = load_spec(spec_path)
    image = next(s.path for s in spec.sources if s.name == "image_caption")
    path = str(source_copies(Path(image), data / "memory-sources", max(counts)))
    out = []
    for kind in ("ours", "webdataset"):
        for n in counts:
            code = MEMORY_CHILD.format(root=str(ROOT), kind=kind, n=n, path=path,
                                       tokenizer=str(spec.tokenizer),
                                       media=spec.media.to_dict())
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True, env=os.environ | {"PYTHONWARNINGS": "ignore"})
            out.append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(f"  memory {kind:>10} {n:>5} sources: +{out[-1]['rss_growth_mib']:.1f} MiB")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "omniscale-bench")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pack", type=int, default=16, help="baseline samples per packed batch")
    ap.add_argument("--sources", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--rounds", type=int, default=6,
                    help="rounds of ours and the two baselines, the order rotating")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    started = provenance()
    workloads = [throughput(demo_spec(args.data, w), w, args) for w in args.workloads]
    mem = memory(demo_spec(args.data), args.sources, args.data)
    result = {"command": " ".join(["tools/bench/loader.py"] + (argv or sys.argv[1:])),
              **started, "workers": args.workers, "workloads": workloads,
              "memory_per_worker": mem, "load_avg_after": os.getloadavg()[0]}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


BASELINES = ("webdataset", "energon")


def throughput(spec_path: Path, workload: str, args) -> dict:
    """Ours against both baselines on one workload, the three alternating over
    ``args.rounds`` rounds (the order rotates each round)."""
    try:
        from omniscale.tools.bench.loader_energon import run_energon
    except ImportError as e:
        raise SystemExit(f"loader bench: Megatron-Energon is a baseline and is not installed "
                         f"({e}); pip install -e '.[bench]'") from None
    # A first, untimed run of ours (the plane's plans are deterministic, so every round draws
    # the same): the baselines mix sources in the proportions it drew, for as many samples.
    steps = args.steps * STEP_FACTOR.get(workload, 1)
    first = run_ours(spec_path, steps, args.workers)
    total = sum(first["drawn_per_source"].values()) or 1
    weights = {k: v / total for k, v in first["drawn_per_source"].items()}
    run = {"ours": lambda: run_ours(spec_path, steps, args.workers),
           "webdataset": lambda: run_baseline(spec_path, first["samples"], args.workers,
                                              weights, args.pack),
           "energon": lambda: run_energon(spec_path, first["samples"], args.workers, weights,
                                          args.pack)}
    sides = ("ours", *BASELINES)
    rounds = []
    for r in range(args.rounds):
        runs = {side: run[side]() for side in sides[r % 3:] + sides[:r % 3]}
        best = max(BASELINES, key=lambda b: runs[b]["samples_per_s"])
        ratio_vs = {b: {k: runs["ours"][k] / runs[b][k] for k in ("samples_per_s",
                                                                  "tokens_per_s")}
                    for b in BASELINES}
        rounds.append({**runs, "best_baseline": best, "ratio": ratio_vs[best],
                       "ratio_vs": ratio_vs})
        print(f"{workload} round {r + 1}/{args.rounds}: ours "
              f"{runs['ours']['samples_per_s']:7.1f} samples/s, webdataset "
              f"{runs['webdataset']['samples_per_s']:7.1f}, energon "
              f"{runs['energon']['samples_per_s']:7.1f}: {ratio_vs[best]['samples_per_s']:.2f}x "
              f"the best ({best})", flush=True)
    keys = ("samples_per_s", "tokens_per_s")
    ratio = {k: _spread([r["ratio"][k] for r in rounds]) for k in keys}
    ratio_vs = {b: {k: _spread([r["ratio_vs"][b][k] for r in rounds]) for k in keys}
                for b in BASELINES}
    print(f"{workload}: median paired ratio to the best baseline "
          f"{ratio['samples_per_s']['median']:.2f}x samples/s "
          f"({ratio['samples_per_s']['min']:.2f}-{ratio['samples_per_s']['max']:.2f}), "
          f"{ratio['tokens_per_s']['median']:.2f}x tokens/s; to webdataset "
          f"{ratio_vs['webdataset']['samples_per_s']['median']:.2f}x, to energon "
          f"{ratio_vs['energon']['samples_per_s']['median']:.2f}x samples/s")
    target = TARGETS.get(workload)
    fields = ("samples_per_s", "tokens_per_s", "data_wait_s", "bytes_per_sample")
    counted = {}
    if workload == "text":  # the baselines tokenize on every read; ours at index time
        cost = index_cost(spec_path)
        per_round = [with_index_cost(r["ours"]["samples_per_s"], cost)
                     / r[r["best_baseline"]]["samples_per_s"] for r in rounds]
        even = [break_even_reads(r["ours"]["samples_per_s"],
                                 r[r["best_baseline"]]["samples_per_s"], cost) for r in rounds]
        counted = {"index_cost": cost, "ratio_with_index_cost": _spread(per_round),
                   "break_even_reads": _spread(even)}
        print(f"text: each sample's index time counted once ({cost['seconds_per_sample'] * 1e3:.1f}"
              f" ms in one process): {statistics.median(per_round):.2f}x the best baseline; "
              f"ours is ahead from {statistics.median(even):.1f} reads of each sample",
              flush=True)
    return {"workload": workload, "rounds": rounds, **counted,
            "target": None if target is None else f">= {target}",
            "met": None if target is None else ratio["samples_per_s"]["median"] >= target,
            # medians over the rounds; "baseline": the faster baseline of each round
            **{side: {k: statistics.median(r[side][k] for r in rounds)
                      for k in fields if k in rounds[0][side]} for side in sides},
            "baseline": {k: statistics.median(r[r["best_baseline"]][k] for r in rounds)
                         for k in fields if k in rounds[0]["webdataset"]},
            "ratio": {k: v["median"] for k, v in ratio.items()}, "ratio_spread": ratio,
            "ratio_vs": {b: {k: v["median"] for k, v in ratio_vs[b].items()}
                         for b in BASELINES}, "ratio_vs_spread": ratio_vs}


def index_cost(spec_path: Path, source: str = "text") -> dict:
    """What ours pays ahead for ``source``: ``omniscale data index`` of it from nothing
    (``force``, into a scratch ``index_dir``, so the bench's own index stays) in one process
    -- reading the tars and tokenizing every sample, which the baselines do on every read.
    Run twice, the second timed: the first loads the libraries and the tokenizer, which a
    large data set's indexing pays once."""
    from omniscale.dataplane.spec import load_spec
    from omniscale.loaders.index import index_paths

    where = Path(next(s.path for s in load_spec(spec_path).sources if s.name == source))
    for _ in range(2):
        with tempfile.TemporaryDirectory() as scratch:
            start = time.perf_counter()
            (report,) = index_paths([where], force=True, progress=False, index_dir=scratch,
                                    workers=1)
            seconds = time.perf_counter() - start
    return {"source": source, "samples": report.samples, "seconds": seconds, "processes": 1,
            "seconds_per_sample": seconds / max(report.samples, 1)}


def with_index_cost(ours_samples_per_s: float, cost: dict, reads: float = 1.0) -> float:
    """Ours' samples/s with each sample's index time shared over ``reads`` reads of it added
    (1: every sample read once, the strict count; the index is built once per data set)."""
    return 1.0 / (1.0 / ours_samples_per_s + cost["seconds_per_sample"] / reads)


def break_even_reads(ours_samples_per_s: float, baseline_samples_per_s: float,
                     cost: dict) -> float:
    """Reads of each sample after which ours, its index time counted, is as fast as the
    baseline (inf when ours is not faster even without it)."""
    saved = 1.0 / baseline_samples_per_s - 1.0 / ours_samples_per_s
    return cost["seconds_per_sample"] / saved if saved > 0 else float("inf")


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


if __name__ == "__main__":
    main()
