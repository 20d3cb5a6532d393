"""``omniscale model``: what a Hugging Face checkpoint is (``info``), one made ready for
training (``import-hf``), and a trained run handed back as one (``export-hf``).

``import-hf DIR --out INIT [--vocab-size N]`` reads the decoder once (one process, the whole
model in memory) and writes it as a torch DCP checkpoint beside a copy of its ``config.json``
and tokenizer files: ``model.init_from.backbone: INIT`` then loads it on any number of ranks,
each rank reading only its own shards (the DCP planner slices the files), which is faster than
every rank reading every tensor of the safetensors for a large model. The checkpoint's
``tokenizer.json`` is written with the special tokens our sequences need
(``omniscale.layout.SPECIAL_TOKENS``: pad, eos, the media markers) added where it lacks them,
after its own ids; the vocabulary then grows to hold them (rounded up to 64, as a run sizes
it), the new embedding and head rows the mean of the old. Point the mixing spec's
``tokenizer:`` at ``INIT/tokenizer.json`` and index with it.

``export-hf RUN_DIR [--step N] --out DIR`` loads the run's checkpoint on this process (DCP
reshards from any number of ranks), and writes the decoder as a Qwen3-MoE / Qwen3 checkpoint
(``config.json``, safetensors shards with an index when more than one, the run's
``tokenizer.json`` and a ``tokenizer_config.json``) that transformers' ``from_pretrained``
loads with no custom code. The omni model's encoders are separate towers beside it:
a vision tower in Qwen2-VL's layout is ``vision/``, a checkpoint of its own that transformers'
``Qwen2VisionTransformerPretrainedModel`` loads; a Whisper- or Qwen2-Audio-layout encoder is
``audio/`` (``WhisperEncoder`` / ``Qwen2AudioEncoder``, its projection to the LLM width beside it
in ``projector.safetensors``); towers in layouts transformers lacks (our ``tiny`` presets) are
``NAME_tower.safetensors`` under our names, their configs in ``omniscale_towers.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from omniscale.errors import UserError

TOWERS = "omniscale_towers.json"


def model_info(path: str | Path) -> dict:
    """Parameters, active parameters, layers, experts and the balancer's cost coefficients of
    the decoder in a Hugging Face checkpoint directory (its config only: no weights read)."""
    from omniscale.backbone.hf import config_from_hf
    from omniscale.encoders.hf_files import CONFIG, read_config

    hf = read_config(path)
    config = config_from_hf(hf, Path(path) / CONFIG)
    alpha, beta = config.cost_coefficients()
    return {"architecture": hf["architectures"][0], "parameters": config.param_count(),
            "active_parameters": config.active_param_count(), "layers": config.n_layers,
            "moe_layers": config.n_moe_layers,
            "experts": config.moe.num_experts if config.moe else 0,
            "top_k": config.moe.top_k if config.moe else 0,
            "vocab_size": config.vocab_size, "d_model": config.d_model,
            "cost_alpha": alpha, "cost_beta": beta}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")


def import_hf(path: str | Path, out: str | Path, vocab_size: int | None = None) -> Path:
    """The decoder of the Hugging Face checkpoint at ``path`` as a DCP checkpoint at ``out``
    (new), its vocabulary grown to ``vocab_size`` (mean rows) when that is larger."""
    import shutil

    from omniscale.backbone.hf import from_hf
    from omniscale.encoders.hf_files import CONFIG, IMPORTED, new_directory, read_config
    from omniscale.parallel.dcp import save

    with new_directory(out) as tmp:
        for name in TOKENIZER_FILES:
            if (Path(path) / name).is_file():
                shutil.copy2(Path(path) / name, tmp / name)
        if (tmp / "tokenizer.json").is_file():
            ids = with_special_tokens(tmp / "tokenizer.json")
            vocab_size = max(vocab_size or 0, -(-ids // 64) * 64)
        decoder, config = from_hf(path, vocab_size)
        save(tmp, decoder)  # one process: DCP writes without a process group
        hf = dict(read_config(path), vocab_size=config.vocab_size)
        (tmp / CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
        (tmp / IMPORTED).write_text(json.dumps({"source": str(Path(path).resolve())}) + "\n")
    return Path(out)


def with_special_tokens(path: Path) -> int:
    """Add to the tokenizer at ``path`` (rewritten) the special tokens our sequences need that
    it lacks, after its own ids; returns how many ids it then has."""
    from tokenizers import AddedToken, Tokenizer

    from omniscale.layout import SPECIAL_TOKENS

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 -- the tokenizers library raises bare Exceptions
        raise UserError(f"{path}: not a readable tokenizer ({' '.join(str(e).split())})"
                        ) from None
    missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t in missing])
        tokenizer.save(str(path))
    return tokenizer.get_vocab_size(with_added_tokens=True)


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """The run's checkpoint (the latest, or ``step``'s) as a Hugging Face checkpoint at
    ``out`` (which must not exist)."""
    import torch  # here, not at the top: every `omniscale` command builds this parser

    from omniscale.backbone.hf import config_to_hf, hf_tensors
    from omniscale.encoders.hf_files import write_checkpoint_dir
    from omniscale.loaders.decode_text import load_tokenizer
    from omniscale.tools.train import checkpoint
    from omniscale.tools.train.build import build_model, model_config
    from omniscale.tools.train.config import run_spec
    from omniscale.tools.train.launch import resolve_config
    from omniscale.tools.train.loop import quiet_torch_notices

    quiet_torch_notices()
    cfg, run_dir = resolve_config(None, str(run_dir), [])
    if cfg.task == "video_gen":
        raise UserError(f"{run_dir}: a video_gen run's DiT has no Hugging Face counterpart")
    found = _checkpoint(run_dir, step)
    spec = run_spec(cfg, cfg.data.spec)
    mcfg = model_config(cfg, spec.media, spec.tokenizer)
    model = build_model(mcfg, cfg.seed, torch.device("cpu"))
    checkpoint.load(found, model, None)
    tokenizer = load_tokenizer(spec.tokenizer, spec.special_tokens)
    special = {"eos": tokenizer.eos_id, "pad": tokenizer.pad_id}
    text = tokenizer.tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        extras = [Path(spec.tokenizer), _tokenizer_config(Path(tmp), text.id_to_token(
            tokenizer.eos_id), text.id_to_token(tokenizer.pad_id))]
        extras += _towers(model, Path(tmp))
        return write_checkpoint_dir(out, config_to_hf(mcfg, special),
                                    hf_tensors(model.decoder.state_dict(), mcfg), extras)


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    from omniscale.tools.train import checkpoint

    if step is None:
        found = checkpoint.latest(run_dir)
        if found is None:
            raise UserError(f"{run_dir}: no finished checkpoint to export")
        return found[1]
    path = checkpoint.checkpoint_dir(run_dir, step)
    if not (path / "meta.json").is_file():
        raise UserError(f"--step {step}: {path} is not a finished checkpoint")
    return path


def _tokenizer_config(tmp: Path, eos: str, pad: str) -> Path:
    """What transformers' AutoTokenizer needs beside ``tokenizer.json``."""
    path = tmp / "tokenizer_config.json"
    path.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                                "pad_token": pad}, indent=2) + "\n")
    return path


def _towers(model, tmp: Path) -> list[Path]:
    """The encoders beside the decoder: a tower in a layout transformers has (Qwen2-VL's
    vision tower, a Whisper or Qwen2-Audio encoder) as its own transformers checkpoint
    (``vision/``, ``audio/``), any other tower's state under our names
    (``NAME_tower.safetensors``) with its config in ``omniscale_towers.json``."""
    from safetensors.torch import save_file

    from omniscale.encoders.hf import audio_to_hf_dir, vision_to_hf_dir

    files, configs = [], {}
    for name, to_hf in (("vision", vision_to_hf_dir), ("audio", audio_to_hf_dir)):
        tower = getattr(model, name)
        if tower is None:
            continue
        try:
            files.append(to_hf(tower, tmp / name))
        except ValueError:  # a layout transformers lacks: its state under our names
            path = tmp / f"{name}_tower.safetensors"
            save_file({k: v.detach().clone() for k, v in tower.state_dict().items()},
                      str(path), metadata={"format": "pt"})
            files.append(path)
            configs[name] = dataclasses.asdict(tower.config)
    if configs:
        (tmp / TOWERS).write_text(json.dumps(configs, indent=2) + "\n")
        files.append(tmp / TOWERS)
    return files


def _info(args: argparse.Namespace) -> int:
    info = model_info(args.dir)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{args.dir}: {info['architecture']}")
    print(f"  parameters {info['parameters']:,} ({info['active_parameters']:,} active per "
          f"token), {info['layers']} layers ({info['moe_layers']} MoE), "
          f"{info['experts']} experts, top-{info['top_k']}")
    print(f"  vocabulary {info['vocab_size']:,}, width {info['d_model']}")
    print(f"  cost model (FLOPs per sequence of L tokens): {info['cost_alpha']:.4g}·L + "
          f"{info['cost_beta']:.4g}·L²")
    return 0


def _import(args: argparse.Namespace) -> int:
    out = import_hf(args.dir, args.out, args.vocab_size)
    print(f"omniscale model: wrote {out} (set model.init_from.backbone: {out})")
    if (out / "tokenizer.json").is_file():
        print(f"omniscale model: its tokenizer, with our special tokens: {out}/tokenizer.json "
              f"(the mixing spec's tokenizer: index with it)")
    return 0


def _export(args: argparse.Namespace) -> int:
    out = export_hf(args.run_dir, args.out, args.step)
    print(f"omniscale model: wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0


def add_commands(commands) -> None:
    model = commands.add_parser("model", help="Hugging Face checkpoints: inspect, import, "
                                "export")
    sub = model.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    info = sub.add_parser("info", help="parameters, experts and cost model of an HF checkpoint")
    info.add_argument("dir", metavar="DIR", help="a Hugging Face checkpoint directory")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_info)
    imp = sub.add_parser("import-hf", help="an HF decoder as a DCP checkpoint for init_from")
    imp.add_argument("dir", metavar="DIR", help="a Hugging Face checkpoint directory")
    imp.add_argument("--out", required=True, metavar="INIT", help="a new directory")
    imp.add_argument("--vocab-size", type=int, default=None,
                     help="grow the vocabulary to this many rows (the run's, when its tokenizer "
                          "has more ids than the checkpoint; new rows: the mean row)")
    imp.set_defaults(func=_import)
    export = sub.add_parser("export-hf", help="a run's checkpoint as a Hugging Face checkpoint")
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--step", type=int, default=None,
                        help="the checkpoint of this step (default: the latest)")
    export.add_argument("--out", required=True, metavar="DIR", help="a new directory")
    export.set_defaults(func=_export)
