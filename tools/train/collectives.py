"""Every collective a training step issues outside the layers' own (FSDP's all-gathers and
reduce-scatters, tensor-parallel reductions, expert and Ulysses all-to-alls, pipeline sends):
named here, so the order the ranks must agree on reads in one place.

A collective waits until every rank of its group calls it; two ranks that call different ones,
or the same ones in a different order, wait for each other forever (NCCL) or until the
collective time-out (gloo). The step modules (``step``, ``pipeline_step``, ``video_gen``,
``guard``, ``records``, ``held_out``, ``checkpoint``, ``loop``) call only these functions;
``tests/tools/test_collective_order.py`` records every rank's sequence in a real multi-rank
step of each task (``step_audit.CollectiveRecorder``) and checks that the ranks agree.

Groups: *data ranks* are the plane's ranks (``StepEnv.group``: this tensor-parallel
slice's data-parallel × sequence-parallel ranks; the world when tp = pp = 1); the *sum group*
is where a step's sums add up (``StepEnv.sum_group``: the data ranks, or the world under
pipeline parallelism, where every stage contributes its own figures once); *world* is every
process of the job.

The sequence, per step (brackets: the layers' own collectives, in the order the layers run;
"if": a collective every rank skips or issues alike, decided by the run's config or by a
verdict every rank shares):

omni
    1. ``reshard_embeddings``: split sizes (all-to-all, [R] int64), then embeddings
       (all-to-all, [N, D]) over the data ranks
    2. ``sum_step_counts`` (all-reduce, [5] float64) over the data ranks
    3. [per micro-batch: FSDP all-gathers, EP / SP all-to-alls, TP reductions; backward:
       FSDP reduce-scatters]
    4. [the reshard's backward all-to-all, then the encoders' FSDP backward]
    5. ``clip_grad_norm``: [each mesh's norm reduced over it], EP squares over each ep group
    6. if ``guard.enabled``: ``guard_verdict`` (all-reduce, [2] float64) over the world
    7. if the step is applied and ``moe.bias_update_rate > 0``: ``sum_expert_loads``
       (all-reduce, [L, E]) over the sum group
    8. if the guard skipped the step: ``gather_suspect_samples`` (object all-gather) over the
       world
lm
    2, 3, 5-8 (a text model encodes nothing: no reshard)
lm with pp > 1
    2 over the data ranks; 3 as the stage's schedule (sends and receives between
    neighbouring stages, FSDP inside each stage); 5 with the stages' squares summed over the
    pipeline group; 6-8, the loads summed over the world
video_gen
    2 ([1] float64: video patches), 3 (the DiT's FSDP), 5, 6, 8

After the step, at points every rank reaches at the same step:

- every ``log_every`` steps, before a checkpoint and before an evaluation's row:
  ``flush_metrics`` (all-reduce of the sums over the sum group, all-gather of the host
  figures and object all-gather of lengths / replaced samples / reads over the data ranks)
- an evaluation (``eval.every``): ``broadcast_held_out`` the first time (world), then per
  scored source ``gather_held_out_counts`` (object all-gather) or, video_gen,
  ``sum_held_out_velocity`` (all-reduce) over the sum group, after the forwards' own
- a checkpoint: ``checkpoint_barrier``, DCP's own collectives, ``checkpoint_barrier``

Once per run: ``share_plane_url`` and, under torchrun with a Ray loader and no address,
``share_ray_address`` (world, before the first step; ``ray_leave_barrier`` after the last),
``gather_checkpoint_verdicts`` (world, when resuming), ``end_of_run_barrier`` (world, after
the last commit);
``full_gradients`` at ``debug.dump_grads_at_step`` (between 4 and 5).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omniscale.parallel import grads
from omniscale.parallel.reshard import Resharded, reshard
from omniscale.plan import ReshardPlan


def share_plane_url(url: str | None) -> str:
    """Rank 0's plane URL on every rank: a broadcast over the world, once, before the loader
    starts."""
    box = [url]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share_ray_address(address: str | None) -> str:
    """Rank 0's Ray address on every rank (torchrun on one node with ``data.loader: ray``
    and no address: rank 0 starts the job's Ray instance): a broadcast over the world, once,
    before the first step."""
    box = [address]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def ray_leave_barrier() -> None:
    """Every rank has left the job's Ray instance but rank 0, which then stops it: a barrier
    over the world, once, after the last step."""
    dist.barrier()


def gather_checkpoint_verdicts(problem: str | None) -> list[str | None]:
    """Every rank's verdict on its share of a checkpoint's files (an object all-gather over
    the world), before DCP loads: every rank refuses alike, none waits in DCP for one that
    stopped."""
    verdicts: list = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, problem)
    return verdicts


def reshard_embeddings(sent: dict, plan: ReshardPlan, group=None, *, dim: int,
                       dtype: torch.dtype, device: torch.device) -> Resharded:
    """The omni step's encoder→LLM exchange over the data ranks (``parallel.reshard.reshard``):
    an all-to-all of each item's row count ([R] int64), then one of the embeddings ([N, D]);
    its backward, one all-to-all of their gradients, runs when the step's ``StepMedia``
    backward reaches it (after every micro-batch's backward). Every data rank calls it, first
    in the step, whatever it encodes or consumes."""
    return reshard(sent, plan, group, dim=dim, dtype=dtype, device=device)


def sum_step_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """The step's global counts (target tokens first: every rank's loss divides by it), an
    all-reduce over the data ranks before the first micro-batch; in place, returned."""
    dist.all_reduce(counts, group=group)
    return counts


def clip_grad_norm(model: torch.nn.Module, clip: float, pp_group=None) -> torch.Tensor:
    """Clip by the global gradient norm (``parallel.grads.clip_grad_norm``): each mesh's norm
    reduced over its mesh (DTensor), expert-parallel squares all-reduced over each ep group,
    pipeline stages' over ``pp_group``. Every rank, after backward, before the guard."""
    return grads.clip_grad_norm(model, clip, pp_group)


def full_gradients(model: torch.nn.Module, pp_group=None) -> dict[str, torch.Tensor]:
    """``debug.dump_grads_at_step``: every parameter's whole gradient
    (``parallel.grads.full_gradients``: FSDP shards gathered on their meshes, experts over
    their ep group, stages' over ``pp_group``). Every rank, between backward and clipping."""
    return grads.full_gradients(model, pp_group)


def guard_verdict(loss_and_bad_norm: torch.Tensor) -> torch.Tensor:
    """The guard's inputs summed over the world (this rank's loss share, whether its gradient
    norm is not finite): every rank reaches the same verdict. After clipping, before the
    optimizer; only with ``guard.enabled``. In place, returned."""
    dist.all_reduce(loss_and_bad_norm)
    return loss_and_bad_norm


def gather_suspect_samples(samples: set) -> list[set]:
    """Every rank's samples of a step the guard did not apply (an object all-gather over the
    world), before the step's commit; only after a skip, which every rank shares."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, samples)
    return gathered


def sum_expert_loads(load_LE: torch.Tensor, group=None) -> torch.Tensor:
    """Aux-loss-free balancing: the step's expert loads all-reduced over the sum group after
    the optimizer (only when the model moves its biases and the step was applied); in place,
    returned."""
    dist.all_reduce(load_LE, group=group)
    return load_LE


def flush_metrics(sums: torch.Tensor, host: torch.Tensor, objects: list, world: int,
                  sum_group=None, group=None) -> tuple[torch.Tensor, list, list]:
    """A log interval's three collectives (``records.flush``): the steps' sums all-reduced over
    the sum group (in place), the host figures ([steps, fields]) all-gathered and the
    per-step objects (lengths, replaced samples, reads) object-all-gathered over the ``world``
    data ranks. Every rank, at the same step: every ``log_every`` steps, before a checkpoint,
    before a row that carries an evaluation."""
    dist.all_reduce(sums, group=sum_group)
    gathered = [torch.zeros_like(host) for _ in range(world)]
    dist.all_gather(gathered, host, group=group)
    gathered_objects: list = [None] * world
    dist.all_gather_object(gathered_objects, objects, group=group)
    return sums, gathered, gathered_objects


def share_from_rank_0(value: int, device: torch.device) -> int:
    """Rank 0's integer on every rank: a broadcast over the world, on the process group's
    device (NCCL takes CUDA tensors only). Every rank calls it, at the same step."""
    box_1 = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(box_1, src=0)
    return int(box_1.item())  # the reply decides what this rank's loader does next


def broadcast_held_out(sets):
    """Rank 0's held-out micro-batches on every rank (a broadcast over the world), at the
    run's first evaluation."""
    box = [sets]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_held_out_counts(counts: tuple, group=None) -> list[tuple]:
    """One source's held-out counts from every rank of the sum group (an object all-gather),
    after its forwards."""
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, counts, group=group)
    return parts


def sum_held_out_velocity(sums: torch.Tensor, group=None) -> torch.Tensor:
    """video_gen: one source's held-out velocity sums all-reduced over the sum group, after its
    forwards; in place, returned."""
    dist.all_reduce(sums, group=group)
    return sums


def checkpoint_barrier() -> None:
    """Every rank at the same point of a checkpoint (the world): before rank 0 snapshots the
    plane (every rank has committed) and before it writes ``meta.json`` (every rank's files are
    written)."""
    dist.barrier()


def end_of_run_barrier(device: torch.device) -> None:
    """After the last commit, on the rank's device (NCCL would otherwise guess the GPU): no
    rank stops the plane while another still talks to it."""
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
