"""One optimizer step of the ``lm`` task under pipeline parallelism (``parallel.pp`` > 1).

Every rank of a pipeline loads the same plan (PP peers share a data rank). The step's
micro-batches run through the stage's schedule (``parallel.pipeline.PipelineRunner``: GPipe or
1F1B) in chunks of ``parallel.pp_microbatches``; the last chunk is filled with placeholder
micro-batches, and every micro-batch is padded to the plane's ``micro_batch_tokens`` (stages
exchange fixed shapes). Gradients accumulate over the chunks, so the update equals one
process's: the cross-entropy is summed and divided once by the global target-token count.

The router losses are per-micro-batch means over equally padded micro-batches, so they are
weighted 1 / (micro-batches over all data ranks): the global mean. Padding tokens reach the
routers, so with a non-zero aux or z-loss (or aux-free bias updates) a pipelined run is not
bit-exact with an unpipelined one; the cross-entropy and its gradients are.

Metrics: the last stage scores the loss (per source, from each token's group id carried with
the labels), the first stage counts the mix, each stage its own MoE layers' loads; one
all-reduce over the world (each quantity contributed by one tensor-parallel copy) gives every
rank the row.
"""

from __future__ import annotations

import torch

from omniscale.tools.train import collectives
from omniscale.tools.train.guard import guarded_update
from omniscale.tools.train.records import StepRecord, StepSums
from omniscale.tools.train.step import (
    RunState,
    StepEnv,
    global_counts,
    mix_counts,
    omni_record,
    placeholder,
    set_lr,
    source_groups,
    update_bias,
)


def schedule_runs(micro_batches: list, size: int) -> list[list]:
    """Runs of ``size`` micro-batches; empty slots and the last run's tail become
    placeholders (all labels ignored)."""
    mbs = [mb if mb.num_tokens else placeholder(mb) for mb in micro_batches]
    mbs += [placeholder(micro_batches[0])] * (-len(mbs) % size)
    return [mbs[i:i + size] for i in range(0, len(mbs), size)]


def _stage_loads(env: StepEnv, model, runner) -> torch.Tensor | None:
    """This stage's MoE loads (L_stage × E) placed at its rows of the whole model's."""
    config = model.config
    if config.moe is None or runner.module.load_LE is None:
        return None
    load_LE = torch.zeros(config.n_moe_layers, config.moe.num_experts, dtype=torch.float64,
                          device=env.device)
    load_LE[_moe_rows(config, runner)] = runner.module.load_LE.to(env.device, torch.float64)
    return load_LE


def pipeline_step(env: StepEnv, state: RunState, step: int, model, optimizer, batch
                  ) -> StepRecord:
    """chunks of micro-batches through the schedule → clip over every stage → AdamW →
    record."""
    cfg, runner = env.cfg, env.pipeline
    state.clock.start()
    lr = set_lr(optimizer, step, cfg)
    optimizer.zero_grad(set_to_none=True)
    chunks = schedule_runs(batch.micro_batches, runner.n_microbatches)
    counts = global_counts(env, batch, [mb for chunk in chunks for mb in chunk])
    n_groups = len(env.sources) + 1
    sums = StepSums.zeros(n_groups, env.device)
    # one copy of each figure enters the world's all-reduce: the loss from the last stage,
    # the mix from the first, loads from every stage, each from tensor-parallel rank 0
    scores = runner.is_last and env.tp_rank == 0
    counts_mix = runner.is_first and env.tp_rank == 0
    router_divisor = env.world * len(chunks) * runner.n_microbatches
    with state.audit.compute(model):
        _run_chunks(env, model, runner, chunks, counts, sums, scores, router_divisor)
    if counts_mix:
        sums.samples_G, sums.tokens_G = mix_counts(env, batch.micro_batches)
    pp_group = runner.stage.group
    env.faults.before_clip(step, model, pp_group)
    with state.audit.compute(model):
        grad_norm = collectives.clip_grad_norm(model, cfg.optim.grad_clip, pp_group)
    # the loss is the last stage's (zeros elsewhere): the guard's world sum is the step's
    skipped = guarded_update(state.guard, optimizer, sums.loss_G.sum(), counts.values[0],
                             grad_norm, contributes=env.tp_rank == 0)
    config = model.config
    if config.moe is not None and sums.load_LE is None:  # no MoE layer here, or a TP copy
        sums.load_LE = torch.zeros(config.n_moe_layers, config.moe.num_experts,
                                   dtype=torch.float64, device=env.device)
    if skipped is None:
        update_bias(env, model, sums.load_LE, _moe_rows(config, runner))
    return omni_record(env, state, step, batch, lr, grad_norm, state.clock.stop(), counts,
                       sums, skipped)


def _run_chunks(env: StepEnv, model, runner, chunks, counts, sums, scores: bool,
                router_divisor: int) -> None:
    """Each chunk through the schedule: the stage's forward and backward passes, its
    loads, and (last stage) its loss per source group."""
    n_groups = len(env.sources) + 1
    for chunk in chunks:
        runner.step(chunk, n_tokens=counts.loss_divisor, router_divisor=router_divisor,
                    groups=[source_groups(mb, env.sources) for mb in chunk],
                    num_groups=n_groups)
        load = _stage_loads(env, model, runner)
        if load is not None and env.tp_rank == 0:
            sums.load_LE = load if sums.load_LE is None else sums.load_LE + load
        if scores:
            sums.loss_G += runner.loss_G.double()
            sums.n_G += runner.n_G.double()
            sums.router += runner.router_sum.double() / router_divisor


def _moe_rows(config, runner) -> slice:
    """This stage's MoE layers among the whole model's."""
    lo, hi = runner.module.layer_range
    first = sum(config.is_moe_layer(i) for i in range(lo))
    return slice(first, first + sum(config.is_moe_layer(i) for i in range(lo, hi)))
