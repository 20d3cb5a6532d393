"""The trainer's tasks, one entry each: how the task builds its model, which
``parallel.parallelize_*`` lays it out, which step trains it, and how its held-out set is
scored (in the ranks, ``held_out``, and in one process, ``evaluate``). The loop, the layout
checks and the evaluations look the run's task up here instead of asking for its name; a new
task is a new entry.

- ``omni``: the decoder LM with its encoders (``step.train_step``: encode, reshard, backbone);
  scored on caption and answer tokens.
- ``lm``: the same decoder without media; pipeline stages allowed (``pipeline_step``); scored
  on next tokens of the text sources.
- ``video_gen``: the rectified-flow DiT (``video_gen``); scored by the held-out velocity loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from omniscale.tools.train import checkpoint
from omniscale.tools.train.build import build_model, model_config
from omniscale.tools.train.config import RunConfig
from omniscale.tools.train.pipeline_step import pipeline_step
from omniscale.tools.train.step import train_step
from omniscale.tools.train.video_gen import build_video_model, evaluate_video_gen, video_gen_step

TEXT_TEMPLATES = ("text",)  # the lm task's held-out sources (templates without media)


@dataclass(frozen=True)
class Task:
    """What differs between tasks (module docstring)."""

    name: str
    # builds a decoder LM from ``build.model_config`` (omni, lm): on the meta device, each rank
    # materialising its shards after parallelization; False: the model is built for real
    language_model: bool
    build: Callable  # (cfg, spec, model config or None, device) -> nn.Module
    parallelize: Callable  # (cfg) -> parallel.parallelize_* with the run's arguments bound
    # (step.StepEnv, step.RunState, step, model, optimizer, batch) -> records.StepRecord
    step: Callable
    scored_sources: Callable  # (eval spec) -> names of the sources the evaluation scores
    held_out_score: str  # the held_out.HeldOut method scoring one source's slice
    load_for_eval: Callable  # (cfg, spec, checkpoint dir) -> (model, score(batches, samples))
    pipeline_step: Callable | None = None  # the step under parallel.pp > 1 (None: refused)
    media_resharded: bool = False  # a rank decodes only the media its plan has it encode
    init_from_hf: bool = True  # model.init_from may name Hugging Face checkpoints
    scored_what: str | None = None  # "caption" / "next-token" accuracy; None: velocity loss


def _build_decoder(cfg: RunConfig, spec, mcfg, device: torch.device):
    # on the meta device: init_weights gives each rank memory for its own shards only, after
    # parallelization (pipeline stages are cut from the meta model too)
    return build_model(mcfg, cfg.seed, torch.device("meta"))


def _build_dit(cfg: RunConfig, spec, mcfg, device: torch.device):
    return build_video_model(cfg, spec, device)


def _parallelize(name: str, cfg: RunConfig):
    from omniscale.parallel import parallelize as plans

    if name == "lm":  # pipeline stages exchange micro-batches padded to the budget
        return partial(plans.parallelize_lm, microbatch_tokens=cfg.data.micro_batch_tokens)
    return getattr(plans, f"parallelize_{name}")


def _load_decoder(cfg: RunConfig, spec, path):
    """The checkpoint's decoder LM, whole, in this process; scored by token accuracy."""
    from omniscale.tools.train import evaluate  # it imports the loop, which imports this

    mcfg = model_config(cfg, spec.media, spec.tokenizer)
    model = build_model(mcfg, cfg.seed, torch.device("cpu"))
    checkpoint.load(path, model, None)
    model.eval()
    return model, lambda batches, samples: evaluate.accuracy_result(
        samples, *evaluate.caption_accuracy(model, batches), mcfg.vocab_size)


def _load_dit(cfg: RunConfig, spec, path):
    """The checkpoint's DiT in this process; scored by the velocity loss at fixed times."""
    model = build_video_model(cfg, spec, torch.device("cpu"))
    checkpoint.load(path, model, None)
    model.eval()
    return model, lambda batches, samples: {
        "samples": samples, **{k: float(v) for k, v in evaluate_video_gen(model, batches).items()}}


def _templates(accept: Callable[[str], bool]) -> Callable:
    return lambda spec: [s.name for s in spec.sources if accept(s.template)]


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("omni", language_model=True, build=_build_decoder,
         parallelize=partial(_parallelize, "omni"), step=train_step,
         # a conversation's labelled tokens are its answers (loaders.chat)
         scored_sources=_templates(lambda t: t.endswith("_caption") or t == "conversation"),
         held_out_score="token_accuracy", load_for_eval=_load_decoder,
         media_resharded=True, scored_what="caption"),
    Task("lm", language_model=True, build=_build_decoder,
         parallelize=partial(_parallelize, "lm"), step=train_step,
         scored_sources=_templates(lambda t: t in TEXT_TEMPLATES),
         held_out_score="token_accuracy", load_for_eval=_load_decoder,
         pipeline_step=pipeline_step, scored_what="next-token"),
    Task("video_gen", language_model=False, build=_build_dit,
         parallelize=partial(_parallelize, "video_gen"), step=video_gen_step,
         scored_sources=_templates(lambda t: t == "video_caption"),
         held_out_score="velocity", load_for_eval=_load_dit, init_from_hf=False),
)}


def task_of(cfg: RunConfig) -> Task:
    """The run's task."""
    return TASKS[cfg.task]
