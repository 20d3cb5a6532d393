"""Loader benchmark: throughput against a DataLoader + webdataset pipeline, memory per worker.

    .venv/bin/python tools/bench/loader.py [--steps 40] [--workers 2] [--out bench-loader.json]

Throughput. The tiny demo (generated under --data unless there), its webdataset sources mixed
from step 0 (Parquet ``docs`` left out: webdataset cannot read it). Ours: an embedded plane
(dp 1) and a RankLoader with ``--workers`` DataLoader workers, every step committed. Baseline:
a ``torch.utils.data.DataLoader`` with the same number of workers over a ``webdataset``
pipeline per source (shards split by worker, sources mixed by ``RandomMix`` in the proportions
ours drew), the same decoders (``SampleDecoder.decode_raw``) and the same packing
(``collate``, one batch per ``--pack`` samples), for the same number of samples. Samples/s and
LLM tokens/s of both, and their ratio, measured in one run.

Memory per worker. A fresh process plays one worker holding N sources (10, 100, 1,000; copies
of the demo's image source): ours decodes one sample of each source through one SampleReader
(bounded LRU of open shards); the baseline opens one webdataset pipeline per source and takes
a sample from each (what a per-source pipeline in every worker holds). RSS growth over the
process before it, per N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

TAR_SOURCES = ("text", "image_caption", "video_caption", "audio_caption", "interleaved")


def demo_spec(data: Path) -> Path:
    """The demo under ``data`` (generated and indexed once) and a spec mixing its tar
    sources from step 0."""
    import yaml

    from loaders.index import index_paths
    from tools.demo import generate

    demo = data / "demo"
    if not (demo / "mix.yaml").is_file():
        generate(demo, scale="tiny", seed=3, progress=False)
        index_paths([demo / "mix.yaml"], progress=False)
    spec = yaml.safe_load((demo / "mix.yaml").read_text())
    spec["sources"] = [s for s in spec["sources"] if s["name"] in TAR_SOURCES]
    spec["schedule"] = {"unit": "steps", "segments": [{"kind": "const", "start": 0, "end": None,
                        "weights": {s: 1 for s in TAR_SOURCES} | {"text": 0.25}}]}
    path = demo / "bench.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_ours(spec_path: Path, steps: int, workers: int) -> dict:
    from dataplane.embedded import start_embedded
    from dataplane.plane import PlaneConfig
    from dataplane.spec import load_spec
    from loaders.pipeline import RankLoader

    spec = load_spec(spec_path)
    config = PlaneConfig(dp=1, micro_batch_tokens=16384, window=4, global_batch_tokens=16384,
                         sp_max=1, snapshot_every=1000)
    per_source: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as state, start_embedded(spec_path, state, config) as p:
        loader = RankLoader(p.url, 0, {s.name: s.path for s in spec.sources}, spec.tokenizer,
                            spec.media, num_workers=workers, prefetch_steps=2)
        with loader:
            first = next(loader)  # worker start-up is not throughput
            loader.commit(first.step)
            start = time.perf_counter()
            samples = tokens = 0
            for _ in range(steps):
                batch = next(loader)
                samples += batch.num_samples
                tokens += batch.num_tokens
                loader.commit(batch.step)
            seconds = time.perf_counter() - start
            wait = loader.data_wait_s
        with_counts = p.plane.status()["sources"]
    for row in with_counts:
        per_source[row["source"]] = row["served_samples"]
    return {"samples": samples, "tokens": tokens, "seconds": seconds,
            "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
            "data_wait_s": wait, "drawn_per_source": per_source}


def run_baseline(spec_path: Path, samples: int, workers: int, weights: dict[str, float],
                 pack: int) -> dict:
    import torch

    from dataplane.spec import load_spec
    from loaders.collate import collate

    spec = load_spec(spec_path)
    dataset = _MixedWebDataset(spec, weights)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers,
                                         collate_fn=lambda x: x, prefetch_factor=4)
    it = iter(loader)
    warm = [next(it) for _ in range(pack)]  # worker start-up is not throughput
    collate([(s, 1, 0) for s in warm], spec.media)
    start = time.perf_counter()
    n = tokens = 0
    chunk = []
    while n < samples:
        sample = next(it)
        chunk.append((sample, 1, 0))
        n += 1
        tokens += len(sample)
        if len(chunk) == pack:
            collate(chunk, spec.media)
            chunk = []
    seconds = time.perf_counter() - start
    del it
    return {"samples": n, "tokens": tokens, "seconds": seconds,
            "samples_per_s": n / seconds, "tokens_per_s": tokens / seconds}


class _MixedWebDataset(torch.utils.data.IterableDataset):
    """An IterableDataset: one webdataset pipeline per source, mixed by weight, decoded with
    our decoders. Built lazily in each worker (shards split by worker)."""

    def __init__(self, spec, weights: dict[str, float]) -> None:
        self.spec, self.weights = spec, weights

    def __iter__(self):
        import webdataset as wds

        from dataplane.refs import SampleRef
        from loaders.decode import SampleDecoder
        from loaders.readers import RawSample, SampleReader

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
from tools.bench.loader import rss_kib, memory_child
print(json.dumps(memory_child({kind!r}, {n}, {path!r}, {tokenizer!r}, {media!r})))
"""


def memory_child(kind: str, n: int, path: str, tokenizer: str, media: dict) -> dict:
    """Run in a fresh process: RSS growth of one worker holding ``n`` sources."""
    import torch  # noqa: F401 -- in both baselines before the measurement starts
    import webdataset as wds

    from loaders.geometry import MediaGeometry
    from loaders.ray_loaders import probe_refs
    from loaders.worker import TimedDecoder, decoder_spec

    ref = probe_refs("image", path, 1)[0]
    shards = sorted(str(p) for p in Path(path).glob("*.tar"))
    names = [f"src{i:04d}" for i in range(n)]
    before = rss_kib()
    held = []
    if kind == "ours":
        decoder = TimedDecoder(decoder_spec({s: path for s in names}, tokenizer,
                                            MediaGeometry(**media)), timeout=None)
        import dataclasses
        for s in names:
            out = decoder.decode(dataclasses.replace(ref, source=s))
            assert out.error is None, out.error
        held.append(decoder)
    else:
        for s in names:
            pipe = iter(wds.WebDataset(shards, shardshuffle=False, empty_check=False))
            next(pipe)  # the pipeline is open on its first shard, as in a running worker
            held.append(pipe)
    return {"kind": kind, "sources": n, "rss_growth_mib": (rss_kib() - before) / 1024}


def memory(spec_path: Path, counts: list[int]) -> list[dict]:
    from dataplane.spec import load_spec

    spec = load_spec(spec_path)
    path = str(next(s.path for s in spec.sources if s.name == "image_caption"))
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
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    spec_path = demo_spec(args.data)
    ours = run_ours(spec_path, args.steps, args.workers)
    print(f"ours:     {ours['samples_per_s']:8.1f} samples/s {ours['tokens_per_s']:10.0f} "
          f"tokens/s  (data wait {ours['data_wait_s']:.2f} s of {ours['seconds']:.2f} s)")
    total = sum(ours["drawn_per_source"].values()) or 1
    weights = {k: v / total for k, v in ours["drawn_per_source"].items()}
    base = run_baseline(spec_path, ours["samples"], args.workers, weights, args.pack)
    print(f"baseline: {base['samples_per_s']:8.1f} samples/s {base['tokens_per_s']:10.0f} "
          f"tokens/s  (DataLoader + webdataset, {args.workers} workers)")
    ratio = {"samples_per_s": ours["samples_per_s"] / base["samples_per_s"],
             "tokens_per_s": ours["tokens_per_s"] / base["tokens_per_s"]}
    print(f"ratio:    {ratio['samples_per_s']:.2f}x samples/s, {ratio['tokens_per_s']:.2f}x "
          "tokens/s (target >= 1.0)")
    mem = memory(spec_path, args.sources)
    result = {"command": " ".join(["tools/bench/loader.py"] + (argv or sys.argv[1:])),
              "workers": args.workers, "ours": ours, "baseline": base, "ratio": ratio,
              "memory_per_worker": mem}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
