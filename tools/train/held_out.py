"""Evaluation during training (``eval.every``) on the sharded model: the held-out set is read
once (rank 0, through the same one-source planes and loaders as ``tools.train.evaluate``) and
sent to every rank; each data rank scores its slice of the micro-batches (every ``world``-th),
the slices padded with placeholder micro-batches so every rank runs the same forwards (FSDP's
collectives line up), and the counts are gathered: the results equal one process's evaluation
of the same weights (tests/tools/test_train_eval.py). The run's last step is evaluated the same
way (``RUN_DIR/eval.json``: what ``result.json`` and the report show).

Evaluation draws nothing from the training stream: its planes are its own (``RUN_DIR/eval``),
it runs under ``torch.no_grad`` in eval mode, and video_gen's noise comes from seeded
generators, so a run with ``eval.every`` trains bit for bit what one without it trains.

Layouts: every one. The slices go by *data* rank (TP and PP peers score the same micro-batches,
as they train the same ones): under TP the head's logits are gathered over the vocabulary
(``parallel.tensor``) and the counts gathered over the data ranks of each TP slice; under SP
each forward runs inside ``sp_batch`` (the held-out plans split no sample, so attention stays
local); under EP the padded slices keep every rank's token exchanges in step; under PP the
slice runs forward only through the stages' schedule (``PipelineRunner.evaluate``, runs of
``pp_microbatches`` padded with placeholders), the last stage scores it and the counts are
summed over the world, each contributed by one last-stage TP copy (as ``pipeline_step`` sums
its figures).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from omniscale.layout import IGNORE_INDEX
from omniscale.tools.train import collectives
from omniscale.tools.train.config import run_spec
from omniscale.tools.train.tasks import task_of


def evaluates_in_ranks(cfg) -> bool:
    """Whether the ranks evaluate this run (during training and after its last step)."""
    return bool(cfg.eval.enabled and cfg.data.eval_spec)


class HeldOut:
    """The run's held-out evaluation inside the ranks (every rank makes one, calls
    :meth:`evaluate` at the same steps). ``ctx``: the run's ``step.StepEnv`` -- the data
    rank and count, the pipeline runner and TP rank, and ``sum_group``, where the counts add up
    (the data ranks of this TP slice; the world under PP, each figure from one rank)."""

    def __init__(self, cfg, run_dir: Path, vocab_size: int | None, ctx) -> None:
        self.cfg, self.run_dir, self.vocab_size, self.ctx = cfg, Path(run_dir), vocab_size, ctx
        self.sets: dict[str, tuple[list, int]] | None = None  # source -> (micro-batches, samples)
        self.spec = run_spec(cfg, cfg.data.eval_spec)

    def due(self, done: int) -> bool:
        every = self.cfg.eval.every
        return done == self.cfg.steps or (every > 0 and done % every == 0)

    def _read(self) -> dict[str, tuple[list, int]]:
        """Rank 0 reads every scored source's held-out micro-batches; all ranks get them."""
        from omniscale.tools.train import evaluate

        sets = None
        if dist.get_rank() == 0:
            out = self.run_dir / "eval"
            out.mkdir(exist_ok=True)
            sets = {source: evaluate._batches(self.cfg, Path(self.cfg.data.eval_spec), source, out)
                    for source in evaluate.scored_sources(self.cfg, self.spec)}
        return collectives.broadcast_held_out(sets)

    def evaluate(self, model, done: int) -> dict:
        """Every source's results after ``done`` steps (every rank gets them); rank 0 writes the
        last step's to ``RUN_DIR/eval.json``."""
        if self.sets is None:
            self.sets = self._read()
        was_training = model.training
        model.eval()
        try:
            with self._precision(model):
                results = {source: self._score(model, mbs, samples)
                           for source, (mbs, samples) in self.sets.items()}
        finally:
            model.train(was_training)
        if done == self.cfg.steps and dist.get_rank() == 0:
            (self.run_dir / "eval.json").write_text(json.dumps(
                {"step": done, "eval": results}, indent=1) + "\n")
        return results

    def _precision(self, model):
        """Autocast to bf16 when the run trains in bf16: FSDP casts the inputs of a module's
        forward (and ``decode``'s), but the DiT's ``velocity`` and the head's logits here are
        called outside one, with fp32 inputs against bf16 parameters."""
        device = next(model.parameters()).device
        precision = self.cfg.parallel.mixed_precision
        bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def _score(self, model, mbs: list, samples: int) -> dict:
        from omniscale.loaders.collate import collate
        from omniscale.tools.train.step import placeholder

        rank, world = self.ctx.rank, self.ctx.world
        # one token, no media, its label ignored: scores nothing, runs every encoder's dummy
        pad = placeholder(collate([], self.spec.media))
        mine = [(i, mb if mb.num_tokens else pad) for i, mb in enumerate(mbs)
                if i % world == rank]
        # every rank the same number of forwards: the longest slice's
        mine += [(None, pad)] * (-(-len(mbs) // world) - len(mine))
        return getattr(self, task_of(self.cfg).held_out_score)(model, mine, samples)

    def token_accuracy(self, model, mine: list, samples: int) -> dict:
        """omni and lm: teacher-forced accuracy of the slice (``mine``: (index or None for
        padding, micro-batch)), through the pipeline's schedule under PP."""
        if self.ctx.pipeline is not None:
            return self._accuracy(samples, *self._stages([mb for _, mb in mine]))
        from omniscale.tools.train import evaluate  # it imports the loop, which imports this

        correct = total = 0
        targets: Counter = Counter()
        with torch.no_grad():
            for i, mb in mine:
                c, n, t = evaluate.scored(model, mb)
                if i is not None:
                    correct, total = correct + c, total + n
                    targets.update(t)
        return self._accuracy(samples, correct, total, targets)

    def _stages(self, mbs: list) -> tuple[int, int, Counter]:
        """PP: the slice forward through the schedule; the last stage's counts (TP rank 0's:
        every other rank's are zero, so the world's sum counts each once)."""
        from omniscale.tools.train.pipeline_step import schedule_runs

        runner = self.ctx.pipeline
        counts = [0, 0, Counter()]
        scores = runner.is_last and self.ctx.tp_rank == 0

        def score(hidden_TD, labels_T):
            mask = labels_T != IGNORE_INDEX
            pred = runner.module.logits(hidden_TD[mask]).argmax(-1)  # every TP peer gathers
            if scores:
                labels = labels_T[mask]
                counts[0] += int((pred == labels).sum())
                counts[1] += int(mask.sum())
                counts[2].update(labels.tolist())

        for run in schedule_runs(mbs, runner.n_microbatches):
            runner.evaluate(run, score)
        return tuple(counts)

    def _accuracy(self, samples: int, correct: int, total: int, targets: Counter) -> dict:
        """The counts summed over the context's ``sum_group``, as one source's row."""
        from omniscale.tools.train import evaluate

        parts = collectives.gather_held_out_counts((correct, total, targets), self.ctx.sum_group)
        correct, total = sum(p[0] for p in parts), sum(p[1] for p in parts)
        return evaluate.accuracy_result(samples, correct, total,
                                        sum((p[2] for p in parts), Counter()), self.vocab_size)

    def velocity(self, model, mine: list, samples: int) -> dict:
        """video_gen: the velocity loss at the eval's fixed times, each batch with the noise
        of its index in the whole set (as one process draws it)."""
        from torch.distributed.fsdp import FSDPModule

        from omniscale.tools.train.video_gen import velocity_result, velocity_sums

        # the DiT's velocity() is no FSDP forward method: its root parameters (time and
        # caption embeddings, the final layer) are gathered here for the evaluation's calls
        root = model if isinstance(model, FSDPModule) else None
        if root is not None:
            root.unshard()
        try:
            with torch.no_grad():
                sums, n = velocity_sums(model, [mb for _, mb in mine],
                                        indices=[i if i is not None else -1 for i, _ in mine])
        finally:
            if root is not None:
                root.reshard()
        # on the model's device: NCCL reduces CUDA tensors only
        both = torch.tensor([*sums, n], dtype=torch.float64,
                            device=next(model.parameters()).device)
        *sums, n = collectives.sum_held_out_velocity(both, self.ctx.sum_group).tolist()
        return {"samples": samples, **velocity_result(sums, n)}


def flat(results: dict) -> dict:
    """``{source/metric: value}``: the metrics row's ``eval`` (one level, as every sink
    names scalars)."""
    return {f"{source}/{k}": v for source, r in results.items() for k, v in r.items()
            if k not in ("loss_sum", "n_targets")}
