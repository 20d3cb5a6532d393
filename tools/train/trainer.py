"""One rank's training loop (``Trainer.run``): the state kept between steps -- the log
interval's records, the metrics writer and progress bar, the tokens trained so far, the
checkpoint being written, the run's measurements (``step.RunState``: compute clock, cost fit
and refit, stragglers, step audit, the guard's history), the watchdog, the profiler -- lives
on the trainer, so the loop reads top to bottom: plan → batch → encode/reshard → backbone →
update → record → commit → evaluate → log → checkpoint. ``loop.py`` sets the rank up (its
fixed ``step.StepEnv``) and hands it one.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from omniscale.dataplane.plane_config import policy_of_window
from omniscale.tools.train import checkpoint, collectives
from omniscale.tools.train.held_out import flat
from omniscale.tools.train.metrics import MetricsWriter, Progress
from omniscale.tools.train.profiler import step_profiler
from omniscale.tools.train.records import StepRecord, flush
from omniscale.tools.train.step import RunState, StepEnv
from omniscale.tools.train.step_audit import recording_collectives
from omniscale.tools.train.watchdog import StepWatchdog


def target_mix(spec, step: int, tokens_before: int) -> dict[str, float]:
    """The schedule's weights for this step (by steps or tokens, as the schedule counts)."""
    x = step if spec.schedule.unit == "steps" else tokens_before
    return {k: round(v, 6) for k, v in spec.schedule.weights_at(x).items()}


class Trainer:
    """The steps of one rank from ``job.start_step``: train, commit, evaluate (``held_out``:
    ``held_out.HeldOut``, every ``eval.every`` steps and after the last), log, checkpoint."""

    def __init__(self, env: StepEnv, run_dir: Path, job, model, optimizer, loader, session,
                 spec, step_fn, held_out=None) -> None:
        self.env, self.cfg, self.run_dir, self.job = env, env.cfg, Path(run_dir), job
        # what the steps measure and remember (the guard's history from before a resume)
        self.state = RunState.start(env, self.run_dir, job.start_step)
        self.model, self.optimizer, self.loader, self.spec = model, optimizer, loader, spec
        self.session = session  # the rank's plane_session.PlaneSession: every plane call
        self.step_fn, self.held_out = step_fn, held_out
        self.rank = dist.get_rank()  # the global rank: files are written by rank 0
        cfg = self.cfg
        self.writer = MetricsWriter(self.run_dir / "metrics.jsonl", job.start_step,
                                    cfg.metrics.wandb, job.raw_config) if env.writer else None
        self.bar = Progress(env.writer, job.progress, cfg.steps, job.start_step, cfg.log_every)
        self.tokens_before = self.writer.tokens_before if self.writer is not None else 0
        # checkpoint.async_save: the writer thread coordinates on a gloo group of its own
        self.async_group = dist.new_group(backend="gloo") if cfg.checkpoint.async_save \
            else None
        self.pending = None  # the checkpoint being written in the background
        self.records: list[StepRecord] = []  # steps since the last log, metrics on the device
        self.watchdog = StepWatchdog(cfg.watchdog.step_timeout_s, self.run_dir, self.rank,
                                     job.start_step) if cfg.watchdog.step_timeout_s > 0 else None
        self.profiler = step_profiler(cfg, self.run_dir, self.rank, env.device, job.start_step)

    def run(self) -> None:
        cfg = self.cfg
        try:
            with recording_collectives(self.rank) as recorder:
                for step in range(self.job.start_step, cfg.steps):
                    if recorder is not None:
                        recorder.mark(f"step {step}")
                    # plan → batch: the loader fetched the step's plan from the plane and
                    # loaded its samples ahead of the step
                    batch = next(self.loader)
                    assert batch.step == step, (batch.step, step)
                    self.env.faults.before_step(step)  # debug.hang
                    # encode/reshard → backbone → update → record: the task's step
                    record = self.step_fn(self.env, self.state, step, self.model,
                                          self.optimizer, batch)
                    self.records.append(record)  # on the device until the log interval
                    self.commit(step, batch, record.update_skipped)
                    self.after_step(step + 1)  # evaluate → log → checkpoint
                checkpoint.finish(self.pending, self.run_dir, self.rank,
                                  cfg.checkpoint.keep_last)
        finally:
            self.close()

    def commit(self, step: int, batch, skipped: str | None) -> None:
        """The step to the plane (a skipped step's samples reported first: the plane still
        holds its plans); the run stops after ``guard.max_skipped_steps`` skips in a row."""
        if skipped is not None:
            self.session.report_suspects(step, batch, skipped, self.rank)
        self.session.commit(step, batch.plan_fp)
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if skipped is not None and self.state.guard.stops_run:
            self.log(flush(self.env, self.state, self.records))
            self.state.guard.stop(step, skipped, self.run_dir)

    def after_step(self, done: int) -> None:
        """Evaluate, log and checkpoint after ``done`` steps, as the config asks."""
        cfg = self.cfg
        held = None
        if self.held_out is not None and self.held_out.due(done):
            with self.watchdog.paused(done - 1) if self.watchdog else contextlib.nullcontext():
                held = self.held_out.evaluate(self.model, done)
        save = done % cfg.checkpoint_every == 0 or (done == cfg.steps and cfg.checkpoint.final)
        if save or done % cfg.log_every == 0 or held:  # every step it covers is logged
            rows = flush(self.env, self.state, self.records)
            if held:
                rows[-1]["eval"] = flat(held)
            self.tell_speeds(rows, done)
            self.log(rows, checkpoint=done if save else None,
                     pools=getattr(self.loader, "pool_stats", None))
            self.records = []
        if save:
            self.session.wait_commits()  # a checkpoint at ``done``: every step before committed
            checkpoint.finish(self.pending, self.run_dir, self.rank, cfg.checkpoint.keep_last)
            self.pending = checkpoint.save(self.run_dir, done, self.model, self.optimizer,
                                           self.session, self.rank,
                                           cfg.checkpoint.keep_last, self.async_group,
                                           faults=self.env.faults)
        if self.profiler is not None:  # profile.steps: the step is the whole iteration
            self.profiler.step(done - 1)

    def tell_speeds(self, rows: list[dict], done: int) -> None:
        """The ranks' speeds to the plane when they changed (rank 0; ``rank_speeds``), to
        apply from step ``done``, which no rank has started: every rank waits here for what
        the plane said (a broadcast, every log interval), and if the plans of ``done`` on are
        new, its loader drops what it fetched of them and fetches them again -- so a slowed
        rank gets less work from the next step, not after the plans its loader read ahead."""
        env, cfg = self.env, self.cfg
        if not rows or not cfg.data.plan_by_rank_speed or cfg.deterministic:
            return
        sent = self.session.tell_speeds(self.state.speeds, env.writer, cfg.deterministic,
                                        from_step=done)
        if sent is not None:
            rows[-1]["rank_speeds_sent"] = sent
        applies = collectives.share_from_rank_0(sent["applies_at_step"] if sent else -1,
                                                env.device)
        if applies == done:  # the plans this rank's loader fetched from there are stale
            self.loader.replan_from(done)

    def log(self, rows: list[dict], checkpoint: int | None = None, pools=None) -> None:
        """Write a log interval's rows (rank 0) with what only the loop knows: the schedule's
        target mix, the cost refit, peak memory, the checkpoint the last row's step starts, the
        Ray decoding pools (``pools``: ``RayRankLoader.pool_stats``)."""
        env, cfg = self.env, self.cfg
        for row in rows:
            step = row["step"]
            if env.device.type == "cuda":  # this rank's peak since the start (GiB)
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated(env.device) / 2 ** 30
            # the placement policy the step's plans came from (its window's turn)
            row["balance"] = policy_of_window(cfg.data.balance, cfg.data.balance_interleave,
                                              step // cfg.data.window)
            if pools is not None:
                row["data_pools"] = pools()
            if "mix_samples" in row:
                row["mix_target"] = target_mix(self.spec, step, self.tokens_before)
            if env.writer and cfg.data.refit_costs_every and \
                    (step + 1) % cfg.data.refit_costs_every == 0:
                row["cost_refit"] = self.refit()
            self.tokens_before += row["tokens"]
            if checkpoint == step + 1:
                row["checkpoint"] = checkpoint
            if self.writer is not None:
                self.writer.write(row)
            self.bar.update(f"loss {row['loss']:.3f}  lr {row['lr']:.2e}  "
                            f"{row['tokens_per_s']:,.0f} tok/s")
        # the plane's status names them
        self.session.tell_stragglers(self.state.stragglers, env.writer)

    def refit(self) -> dict | None:
        """The cost model refitted and sent (``cost_model.refit_and_send``)."""
        return self.session.refit(self.state.refit, self.cfg.deterministic)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.profiler is not None:
            self.profiler.close()
