"""Loader benchmark's second baseline: Megatron-Energon, run as its users run it.

Each tar source is prepared once (``energon prepare --non-interactive --split-ratio 1,0,0
--sample-type CrudeWebdataset``: every shard in ``train``, a crude dataset; redone only when
its tars change) and the sources are blended by a ``MetadatasetV2`` YAML whose ``blend:``
weights are the workload's (weight 0 left out). ``get_train_dataset`` (``WorkerConfig(rank=0,
world_size=1, num_workers=--workers)``) and ``get_loader`` run it: a TaskEncoder without
Energon's media decoder (the cooker gets the tar's raw bytes) whose ``Cooker`` decodes each
sample with our decoders (``SampleDecoder.decode_raw``, as the webdataset baseline does; a
sample that fails is Energon's ``SkipSample``) and whose ``batch`` packs them with our
``collate`` in the workers (``batch_size=--pack``: one batch of tensors handed over per
``--pack`` samples, Energon's batched transfer; no padding). Its fastest fair settings: no
shuffle buffer, each worker reading its shard slices whole and in order
(``max_samples_per_sequence=None``, ``parallel_shard_iters=1``: ours reads by plan, the
webdataset baseline shard by shard), the watchdog off, and the DataLoader prefetch of the
webdataset baseline (4 batches per worker). The first batch (worker start-up) is not timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from megatron.energon import (
    Cooker,
    Sample,
    SkipSample,
    TaskEncoder,
    WorkerConfig,
    basic_sample_keys,
    edataclass,
    get_loader,
    get_train_dataset,
    stateless,
)

STAMP = "omniscale-bench.json"  # in a prepared source's .nv-meta: the tars it was prepared from


def _tars(path: Path) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(path.glob("*.tar"))}


def prepare(spec, names: set[str] | None = None) -> None:
    """``energon prepare`` each tar source of a loaded spec (``dataplane.spec.load_spec``; those
    in ``names`` if given) as a CrudeWebdataset with every shard in ``train``, without prompting;
    a source whose tars are those it was last prepared from is left as it is. One process runs
    the CLI's command for every source (a process per source paid Energon's import each time:
    most of a small source's preparation)."""
    todo = []
    for s in spec.sources:
        path = Path(s.path)
        if names is not None and s.name not in names:
            continue
        tars = _tars(path)
        stamp = path / ".nv-meta" / STAMP
        if not tars or (stamp.is_file() and json.loads(stamp.read_text()) == tars):
            continue
        todo.append((path, tars))
    if not todo:
        return
    commands = [["prepare", str(path), "--non-interactive", "--force-overwrite",
                 "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset", "--no-progress",
                 "--num-workers", str(min(len(tars), os.cpu_count() or 1))]
                for path, tars in todo]
    # the commands on stdin: a thousand sources' would pass the limit of a command line
    run_each = ("import json, sys\n"
                "from megatron.energon.cli.main import main\n"
                "for args in json.load(sys.stdin):\n"
                "    main(args, standalone_mode=False)\n")
    subprocess.run([sys.executable, "-c", run_each], input=json.dumps(commands), text=True,
                   stdout=subprocess.DEVNULL, check=True)
    for path, tars in todo:
        (path / ".nv-meta" / STAMP).write_text(json.dumps(tars))


def metadataset(spec, weights: dict[str, float]) -> dict:
    """The MetadatasetV2 an Energon user writes to blend the sources by weight: each source's
    name in its subflavors (the cooker's ``source``)."""
    blend = [{"weight": float(weights[s.name]), "path": str(Path(s.path).resolve()),
              "subflavors": {"source": s.name}}
             for s in spec.sources if weights.get(s.name, 0) > 0 and _tars(Path(s.path))]
    if not blend:
        raise ValueError(f"no tar source has a weight > 0 in {weights}")
    return {"__module__": "megatron.energon", "__class__": "MetadatasetV2",
            "splits": {"train": {"blend": blend}}}


@edataclass
class CookedSample(Sample):
    """A cooked sample: our decoder's output (``loaders.sequence.DecodedSample``)."""

    decoded: object


class OmniTaskEncoder(TaskEncoder):
    """Crude samples cooked by our decoders, batched by our collate."""

    decoder = None  # no Energon media decoding: the cooker gets the tar's raw bytes

    def __init__(self, spec) -> None:
        self.spec = spec
        self.cookers = (Cooker(self.cook),)
        self._decoder = None  # built in each worker, on its first sample

    @stateless
    def cook(self, crude: dict) -> CookedSample:
        from omniscale.loaders.decode import SampleDecoder
        from omniscale.loaders.readers import RawSample, SampleReader
        from omniscale.refs import SampleRef

        if self._decoder is None:
            self._decoder = SampleDecoder(SampleReader({}), self.spec.tokenizer, self.spec.media)
        name, key = crude["__subflavors__"]["source"], crude["__key__"]
        members = tuple((f"{key}.{k}", v) for k, v in crude.items() if not k.startswith("__"))
        try:
            out = self._decoder.decode_raw(SampleRef(0, name, "", key, 0, 0),
                                           RawSample(name, key, members))
        except Exception:  # noqa: BLE001 -- the baseline skips what it cannot decode
            raise SkipSample() from None
        return CookedSample(**basic_sample_keys(crude), decoded=out)

    @stateless
    def batch(self, samples: list[CookedSample]):
        from omniscale.loaders.collate import collate

        return collate([(s.decoded, 1, 0) for s in samples], self.spec.media)


def energon_loader(spec_path: Path, workers: int, weights: dict[str, float], pack: int):
    """Energon's loader over the spec's tar sources (prepared first), blended by ``weights``:
    it yields PackedBatches of ``pack`` samples."""
    import yaml

    from omniscale.dataplane.spec import load_spec

    spec = load_spec(spec_path)
    prepare(spec, {name for name, w in weights.items() if w > 0})
    with tempfile.TemporaryDirectory() as tmp:  # read when the dataset is built
        mds = Path(tmp) / "blend.yaml"
        mds.write_text(yaml.safe_dump(metadataset(spec, weights)))
        dataset = get_train_dataset(
            mds, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
            batch_size=pack, shuffle_buffer_size=None, max_samples_per_sequence=None,
            parallel_shard_iters=1, task_encoder=OmniTaskEncoder(spec))
    return get_loader(dataset, prefetch_factor=4, watchdog_timeout_seconds=None)


def run_energon(spec_path: Path, samples: int, workers: int, weights: dict[str, float],
                pack: int) -> dict:
    from omniscale.tools.bench.loader import collect_before_fork, time_batches

    collect_before_fork()
    with warnings.catch_warnings():  # its loader always asks for pinned memory; none on CPU
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true")
        it = iter(energon_loader(spec_path, workers, weights, pack))
    out = time_batches(it, samples)
    it.close()  # its persistent workers end with it
    return out
