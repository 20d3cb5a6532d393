"""Caption accuracy on the held-out split: teacher-forced next-token accuracy on the caption
tokens (the only labelled positions of a caption sample) of every ``*_caption`` source of the
eval spec -- and on the answer tokens of every conversation source (its labels are the
assistant's turns, ``loaders.chat``) -- with two chance levels beside it: uniform
(1 / vocabulary) and the majority baseline (always predicting the most frequent target token of
that source's eval captions).

``evaluate_run`` evaluates a checkpoint in one process, on the whole unsharded model
(``parallel.dcp`` loads any layout into any other): the independent evaluation the ranks'
(``held_out``, which reuses this module's scoring and batches) is tested against, and the
launcher's fallback when the ranks wrote none for the last step. Each source is read through its
own one-source plane (``samples`` accounting, ``stop`` at exhaustion), so the same loaders and
decoders as training produce the batches.
"""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path

import torch
import yaml

from omniscale.dataplane.embedded import start_embedded
from omniscale.dataplane.plane import PlaneConfig
from omniscale.layout import IGNORE_INDEX
from omniscale.loaders.pipeline import RankLoader
from omniscale.location import is_url
from omniscale.parallel.sequence import sp_batch
from omniscale.tools.train import checkpoint
from omniscale.tools.train.config import RunConfig, run_spec
from omniscale.tools.train.loop import cache_config
from omniscale.tools.train.plane_session import loader_for
from omniscale.tools.train.tasks import task_of


def _one_source_spec(eval_spec: Path, name: str, out: Path) -> Path:
    raw = yaml.safe_load(eval_spec.read_text())
    base = eval_spec.parent
    src = next(s for s in raw["sources"] if s["name"] == name)
    path = src["path"] if is_url(src["path"]) else str((base / src["path"]).resolve())
    raw["sources"] = [dict(src, path=path, weight=1)]
    if raw.get("index_dir") and not is_url(raw["index_dir"]):
        raw["index_dir"] = str((base / raw["index_dir"]).resolve())
    if src.get("chat_template") not in (None, "chatml", "tokenizer"):  # a file beside the spec
        raw["sources"][0]["chat_template"] = str((base / src["chat_template"]).resolve())
    raw["tokenizer"] = str((base / raw["tokenizer"]).resolve())
    raw.pop("schedule", None)
    raw.update(accounting="samples", on_exhausted="stop")
    out.write_text(yaml.safe_dump(raw))
    return out


@torch.no_grad()
def scored(model, mb) -> tuple[int, int, Counter]:
    """(correct, counted, target-token counts) of one micro-batch, teacher-forced: the model's
    own ``encode_media`` and ``decode`` (under FSDP, forward methods: every rank must call
    them alike; under SP inside ``sp_batch``, a no-op otherwise), then the head's argmax at the
    labelled positions."""
    media = model.encode_media(mb)
    with sp_batch(model, mb):
        hidden_TD, _ = model.decode(mb, media.items)
    labels_T = mb.labels_T.to(hidden_TD.device)
    mask = labels_T != IGNORE_INDEX
    pred = model.decoder.logits(hidden_TD[mask]).argmax(-1)
    labels = labels_T[mask]
    return int((pred == labels).sum()), int(mask.sum()), Counter(labels.tolist())


def caption_accuracy(model, batches) -> tuple[int, int, Counter]:
    """(correct, counted, target-token counts) over the micro-batches."""
    correct = total = 0
    targets: Counter = Counter()
    for mb in batches:
        if mb.num_tokens == 0:
            continue
        c, n, t = scored(model, mb)
        correct, total = correct + c, total + n
        targets.update(t)
    return correct, total, targets


def accuracy_result(samples: int, correct: int, total: int, targets: Counter,
                    vocab_size: int) -> dict:
    """One source's row: accuracy beside the uniform and majority-token chance levels."""
    return {"samples": samples, "tokens": total,
            "accuracy": correct / total if total else 0.0,
            "chance_uniform": 1.0 / vocab_size,
            "chance_majority": max(targets.values()) / total if total else 0.0}


def scored_sources(cfg: RunConfig, spec) -> list[str]:
    """The eval spec's sources the task scores: lm, the text sources; omni, the captions and
    conversations (a conversation's labelled tokens are its answers, loaders.chat); video_gen,
    the video captions (``tasks.Task.scored_sources``)."""
    return task_of(cfg).scored_sources(spec)


def report(cfg: RunConfig, spec, results: dict, step: int) -> None:
    """The results as the user sees them (a table; video_gen: one line)."""
    what = task_of(cfg).scored_what
    if what is None:  # video_gen
        print(f"held-out velocity loss (checkpoint step {step}): " + ", ".join(
            f"{n} {r['loss']:.4f}" for n, r in results.items()))
        return
    if results and all(s.template == "conversation" for s in spec.sources if s.name in results):
        what = "answer-token"
    _print(results, step, what)


def _batches(cfg: RunConfig, eval_spec: Path, source: str, out_dir: Path):
    """Up to ``eval.max_samples`` held-out samples of one source, as training micro-batches."""
    one = run_spec(cfg, _one_source_spec(eval_spec, source, out_dir / f"{source}.yaml"))
    state = out_dir / f"plane-{source}"
    shutil.rmtree(state, ignore_errors=True)
    config = PlaneConfig(dp=1, micro_batch_tokens=cfg.data.micro_batch_tokens,
                         global_batch_samples=8, sp_max=1, window=1)
    batches, samples = [], 0
    cache = cache_config(cfg)
    with start_embedded(one.path, state, config) as plane:
        loader = loader_for(plane.url, 0, RankLoader, one.locations, one.tokenizer, one.media,
                            num_workers=0, special_tokens=one.special_tokens,
                            indexes=one.indexes, cache=cache)
        try:
            for batch in loader:
                batches += batch.micro_batches
                samples += batch.num_samples
                loader.commit(batch.step)
                if samples >= cfg.eval.max_samples:
                    break
        finally:
            loader.close(raise_commit_errors=sys.exc_info()[0] is None)
    return batches, samples


def evaluate_run(cfg: RunConfig, run_dir: Path, verbose: bool = True) -> dict:
    """Held-out results of the run's last checkpoint, per source of ``cfg.data.eval_spec``:
    omni, caption-token accuracy of every ``*_caption`` source; lm, next-token accuracy of the
    text sources; video_gen, the velocity loss of the video captions at fixed timesteps."""
    from omniscale.tools.train.loop import quiet_torch_notices

    quiet_torch_notices()
    found = checkpoint.latest(run_dir)
    if found is None:
        return {}
    eval_spec = Path(cfg.data.eval_spec)
    spec = run_spec(cfg, eval_spec)
    out_dir = run_dir / "eval"
    out_dir.mkdir(exist_ok=True)
    _, score = task_of(cfg).load_for_eval(cfg, spec, found[1])
    results = {}
    for source in scored_sources(cfg, spec):
        results[source] = score(*_batches(cfg, eval_spec, source, out_dir))
    if verbose:
        report(cfg, spec, results, found[0])
    return results


def _print(results: dict, step: int, what: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"held-out {what} accuracy (teacher-forced, checkpoint step {step})")
    for col in ("source", "samples", "tokens", "accuracy", "chance: majority token",
                "chance: uniform"):
        table.add_column(col, justify="left" if col == "source" else "right")
    for name, r in results.items():
        table.add_row(name, str(r["samples"]), str(r["tokens"]), f"{r['accuracy']:.3f}",
                      f"{r['chance_majority']:.3f}", f"{r['chance_uniform']:.5f}")
    Console().print(table)
