"""What a micro-batch and a moved media item cost *on the run's layout*: ``nproc`` ranks on gloo
(or NCCL), the model sharded as the trainer shards it.

``balance calibrate`` times the backbone in one process; a real run also pays, for every
micro-batch, FSDP's parameter gathers (forward, and again in backward) and its gradient
reduce-scatter, and for every media item encoded away from its consumer, the all-to-all that
moves its embeddings there (and the gradient back). The planner adds a micro-batch slot or
moves an item only when its model says it pays, so both prices have to be those of the run:

- **per micro-batch**: steps of m one-token micro-batches (the trainer's placeholder: next to
  nothing to compute, every collective a real one pays), m = 1..4, on every rank at once;
  the slope of the median seconds over m is the fixed cost of one more micro-batch.
- **per step**: what a step pays once whatever it trains -- the gradient norm's clip and the
  AdamW update on the sharded parameters. It changes no plan (every plan pays it once), but a
  step's predicted time without it is short by that much (``llm.per_step`` in the cost file;
  ``tools/bench/e2e_long_tail.py`` adds it to each predicted step).
- **reshard per token**: the trainer's all-to-all of embedding rows (``d_model`` wide, the
  model's dtype) and the one that brings their gradients back, each rank sending T rows to
  every other, for a few T; the slope over the rows a rank sends is the price per token the
  encoder plan weighs a move by (``Costs.reshard_per_token``).

Every time is the median of ``repeats`` runs, each after a barrier, and the slowest rank's
(the step waits for it).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

MICRO_BATCHES = (1, 2, 3, 4)
RESHARD_ROWS = (0, 1024, 4096, 16384)  # rows each rank sends to each other rank


def measure(config: str, sets: list[str], nproc: int, repeats: int) -> dict:
    """``{per_micro_batch, reshard_per_token, ...}`` in seconds, measured on ``nproc``
    processes (module docstring)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="omniscale-layout-") as tmp:
        out = Path(tmp)
        try:
            mp.start_processes(_rank, args=(nproc, config, list(sets), repeats, str(out)),
                               nprocs=nproc, start_method="spawn")
        except mp.ProcessExitedException as e:
            # gloo's teardown has aborted a process after the measurement was saved (seen
            # twice in many runs): the figures are whole (written, then renamed), so they stand
            if not (out / "layout.pt").exists():
                raise
            print(f"calibrate_layout: {e} after the measurement was saved; using it", flush=True)
        result = torch.load(out / "layout.pt", weights_only=True)
    return result


def _slope(xs, ys) -> tuple[float, float]:
    """Least squares ``y = a + b·x``: (b, a), b at least 0 (noise cannot make more cost less)."""
    b, a = np.polyfit(np.asarray(xs, np.float64), np.asarray(ys, np.float64), 1)
    return max(float(b), 0.0), float(a)


def _timed(run, repeats: int, device: torch.device) -> float:
    """Median seconds of ``run`` over ``repeats``, each the slowest rank's."""
    import torch.distributed as dist

    seconds = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        seconds.append(float(took))
    return statistics.median(seconds)


def _rank(rank: int, world: int, config: str, sets: list[str], repeats: int, out: str) -> None:
    import torch.distributed as dist

    from omniscale.tools.train.config import load_config
    from omniscale.tools.train.loop import device_of, quiet_torch_notices, rank_threads

    quiet_torch_notices()  # as a training rank does: torch's notices a user cannot act on
    cfg, _ = load_config(config, sets)
    device = device_of(cfg, rank)
    cfg = cfg.on_device(device.type)
    torch.set_num_threads(rank_threads(world))  # as a training rank
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{out}/store", rank=rank, world_size=world)
    try:
        model, media = _sharded_model(cfg, world, device)
        per_mb = [_timed(_micro_batches(model, media, m, device), repeats, device)
                  for m in MICRO_BATCHES]
        dim, dtype = model.config.d_model, model.decoder.embed_tokens.weight.dtype
        moved = [_timed(_reshard(rows, world, dim, dtype, device), repeats, device)
                 for rows in RESHARD_ROWS]
        update = _update(model, media, cfg, device)
        update()  # warm-up: the first step allocates AdamW's state
        per_step = _timed(update, repeats, device)
        slope, base = _slope(MICRO_BATCHES, per_mb)
        sent = [rows * (world - 1) for rows in RESHARD_ROWS]  # rows one rank sends
        per_token, fixed = _slope(sent, moved)
        if rank == 0:
            torch.save({"nproc": world, "per_micro_batch": slope, "step_base_s": base,
                        "per_step": per_step,
                        "micro_batch_seconds": dict(zip(map(str, MICRO_BATCHES), per_mb)),
                        "reshard_per_token": per_token, "reshard_fixed_s": fixed,
                        "reshard_seconds": dict(zip(map(str, sent), moved)),
                        "dtype": str(dtype).removeprefix("torch."),
                        "layers": model.decoder.config.n_layers},
                       Path(out) / "layout.pt.partial")
            (Path(out) / "layout.pt.partial").rename(Path(out) / "layout.pt")
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's finalization: a gloo worker thread that still holds a
    # tensor takes the GIL while Python tears down and is stopped by it, inside C++ code that
    # may not unwind -- the process aborts ("terminate called without an active exception")
    # after its figures were saved, and spawn kills its peer. Nothing else needs flushing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _sharded_model(cfg, world: int, device: torch.device):
    """The run's model, frozen and sharded as ``tools.train.loop`` does it, and the spec's
    media geometry."""
    from omniscale.tools.train import optim_groups
    from omniscale.tools.train.build import init_weights
    from omniscale.tools.train.loop import layout, settings_of
    from omniscale.tools.train.tasks import task_of

    spec, mcfg, dims, groups = layout(cfg, world)
    task = task_of(cfg)
    model = task.build(cfg, spec, mcfg, device)
    optim_groups.freeze(model, groups)
    task.parallelize(cfg)(model, dims, settings_of(cfg, device), device.type)
    init_weights(model, cfg, device, resume=False)
    return model, spec.media


def _micro_batches(model, media, m: int, device: torch.device):
    """Forward + backward of ``m`` one-token micro-batches, as the trainer runs a step's."""
    from omniscale.kernels.transfer import host_to_device
    from omniscale.loaders.collate import collate
    from omniscale.parallel.sequence import sp_batch
    from omniscale.tools.train.step import placeholder

    mb = placeholder(collate([], media))

    def run():
        model.zero_grad(set_to_none=True)
        for _ in range(m):
            with sp_batch(model, mb):  # SP layouts: the attention's layout, as in a step
                hidden_TD, aux = model.decode(mb, [])
                loss, _ = model.decoder.loss(hidden_TD, host_to_device(mb.labels_T, device))
                (loss + aux["router_loss"]).backward()
    return run


def _update(model, media, cfg, device: torch.device):
    """What a step pays once whatever its micro-batches: the global gradient norm's clip and
    the AdamW update, as the trainer runs them (``step.train_step``), on the gradients of one
    micro-batch."""
    from omniscale.tools.train import collectives
    from omniscale.tools.train.build import build_optimizer

    optimizer = build_optimizer(model, cfg)
    _micro_batches(model, media, 1, device)()  # gradients to update with

    def run():
        collectives.clip_grad_norm(model, cfg.optim.grad_clip)
        optimizer.step()
    return run


def _reshard(rows: int, world: int, dim: int, dtype: torch.dtype, device: torch.device):
    """The embeddings' all-to-all (``rows`` to every other rank) and the gradients' back."""
    import torch.distributed as dist

    splits = [0 if r == dist.get_rank() else rows for r in range(world)]
    send = torch.randn(rows * (world - 1), dim, device=device).to(dtype)
    recv = torch.empty_like(send)

    def run():
        dist.all_to_all_single(recv, send, splits, splits)
        dist.all_to_all_single(send, recv, splits, splits)  # the gradients, back
    return run
