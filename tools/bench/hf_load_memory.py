"""Host memory of starting from a Hugging Face checkpoint under FSDP: how much each rank's
peak resident memory grows while it loads a Qwen3-MoE, our sharded load against two ways a
user would otherwise start (issue 20: "each rank materialises only its shard").

    .venv/bin/python tools/bench/hf_load_memory.py --out docs/bench/hf_load_memory.json

Methods, each on 2 gloo processes (fresh ones per measurement), the same safetensors:

- ``sharded`` (ours, what ``model.init_from.backbone`` does in the trainer): the decoder built
  on the meta device, ``fully_shard`` per layer and at the root, memory for this rank's shards
  only (``to_empty``), then ``parallel.load.fill_parameters`` reading one tensor at a time
  (``backbone.hf.read_parameter``) and keeping the rank's shard of it.
- ``whole_then_shard``: ``backbone.hf.from_hf`` (the whole decoder built and loaded in each
  rank), then ``fully_shard`` -- a trainer without a sharded load.
- ``transformers``: ``Qwen3MoeForCausalLM.from_pretrained`` in each rank (the peer's own
  loader, no sharding afterwards: what each rank holds before any FSDP wrapping).

The figure is the growth of the kernel's peak resident size (``VmHWM``, reset by
``clear_refs`` just before the load, after every import and a small warm-up of the same path),
per rank; the model's fp32 size and a rank's shards are reported beside it. Rounds alternate
the methods; the medians are reported, and ``sharded`` over each baseline.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

METHODS = ("sharded", "whole_then_shard", "transformers")
FULL = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=512,
            num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
QUICK = dict(FULL, vocab_size=1024, num_hidden_layers=2, num_experts=4,
             moe_intermediate_size=128, intermediate_size=128)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def _reset_peak() -> int:
    """Free what can be freed, reset the peak resident size to the current one; answer it."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmHWM")


def _load(method: str, path: Path):
    import torch
    from torch.distributed.fsdp import fully_shard

    from omniscale.backbone.decoder import MoEDecoder
    from omniscale.backbone.hf import config_from_hf, from_hf, read_parameter
    from omniscale.encoders.hf_files import CheckpointDir
    from omniscale.parallel.load import fill_parameters

    if method == "transformers":
        import transformers

        transformers.utils.logging.disable_progress_bar()
        return transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    if method == "whole_then_shard":
        decoder, _ = from_hf(path)
    else:
        ckpt = CheckpointDir(path)
        with torch.device("meta"):
            decoder = MoEDecoder(config_from_hf(ckpt.config))
    for layer in decoder.layers:
        fully_shard(layer)
    fully_shard(decoder)
    if method == "sharded":
        decoder.to_empty(device="cpu")  # memory for this rank's shards only
        with torch.no_grad():
            for b in decoder.buffers():
                (b.to_local() if hasattr(b, "to_local") else b).zero_()
        fill_parameters(decoder, lambda name, shape, first: read_parameter(
            ckpt, name, shape, first))
    return decoder


def _rank(rank: int, world: int, store: str, method: str, path: str, warm: str, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        _load(method, Path(warm))  # imports, DTensor's caches: paid once per process
        before = _reset_peak()
        model = _load(method, Path(path))
        growth = _status_bytes("VmHWM") - before
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4
                    for p in model.parameters())
        queue.put((rank, {"growth_bytes": growth, "held_bytes": local}))
    finally:
        dist.destroy_process_group()


def measure(method: str, path: Path, warm: Path, world: int = 2) -> list[dict]:
    """Each rank's peak growth while loading ``path`` by ``method`` (fresh processes)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store, method, str(path), str(warm),
                                                 queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
            if p.exitcode:
                raise RuntimeError(f"{method}: a rank exited with {p.exitcode}")
    return [results[r] for r in range(world)]


def _save(config: dict, path: Path) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))
    model.save_pretrained(path)
    return sum(p.numel() * 4 for p in model.parameters())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("hf_load_memory.json"))
    args = parser.parse_args(argv)
    from omniscale.tools.bench.provenance import provenance

    source = provenance()  # before the run: the load it started under
    config, rounds = (QUICK, 1) if args.quick else (FULL, args.rounds)
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        path, warm = Path(tmp) / "model", Path(tmp) / "warm"
        full = _save(config, path)
        _save(dict(config, num_hidden_layers=1, vocab_size=256), warm)
        print(f"Qwen3-MoE of {full / mib:.1f} MiB (fp32), 2 ranks, {rounds} round(s)")
        runs: dict[str, list] = {m: [] for m in METHODS}
        for i in range(rounds):
            order = METHODS if i % 2 == 0 else METHODS[::-1]  # alternate the order
            for method in order:
                ranks = measure(method, path, warm)
                runs[method].append(ranks)
                print(f"round {i + 1} {method}: peak growth per rank " + ", ".join(
                    f"{r['growth_bytes'] / mib:.1f} MiB" for r in ranks), flush=True)
    median = {m: statistics.median(max(r["growth_bytes"] for r in ranks) for ranks in runs[m])
              for m in METHODS}
    doc = {"model_bytes": full, "world": 2, "rounds": rounds, "config": config,
           "median_peak_growth_bytes": median,  # the larger rank's, median over rounds
           "held_bytes": {m: runs[m][0][0]["held_bytes"] for m in METHODS},
           "sharded_over": {m: median["sharded"] / median[m] for m in METHODS[1:]},
           "sharded_growth_over_model": median["sharded"] / full,
           "sharded_beyond_shards_bytes": median["sharded"] - runs["sharded"][0][0]["held_bytes"],
           "runs": runs, "provenance": source}
    for m in METHODS:
        print(f"{m:>17}: peak growth {median[m] / mib:7.1f} MiB per rank "
              f"({median[m] / full:.2f}x the model), holds {doc['held_bytes'][m] / mib:.1f} MiB")
    print("sharded / " + ", sharded / ".join(f"{m}: {v:.3f}x"
                                              for m, v in doc["sharded_over"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
