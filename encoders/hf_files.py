"""Hugging Face checkpoint directories: read lazily, tensor by tensor, and written in shards.

A checkpoint directory holds ``config.json`` and its weights in safetensors: one
``model.safetensors``, or shards listed by ``model.safetensors.index.json`` (tensor name ->
shard file). :class:`CheckpointDir` reads one tensor at a time (safetensors memory-maps the
file and copies out only the tensor, or the rows, asked for), so importing a model never holds
more than the tensor in hand beyond the model itself. Every problem is one line naming the file
and the tensor. :func:`write_checkpoint_dir` writes the same layout, shard by shard, into a
temporary directory renamed into place at the end: a failed export leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from omniscale.errors import UserError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
IMPORTED = "omniscale_import.json"  # marks `omniscale model import-hf`'s DCP directories
SHARD_BYTES = 2 << 30  # the most one written shard holds (HF's own default is 5 GB)


class CheckpointDir:
    """``config.json`` and the tensors of a Hugging Face checkpoint directory, by name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise UserError(f"{self.path}: not a directory (a Hugging Face checkpoint holds "
                            f"{CONFIG} and safetensors)")
        self.config = _read_json(self.path / CONFIG)
        if (self.path / INDEX).is_file():
            self.listing = self.path / INDEX  # what says where each tensor is
            weight_map = _read_json(self.path / INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UserError(f"{self.path / INDEX}: no 'weight_map' of tensor -> shard")
            # shards are opened when a tensor of theirs is read: a tower's import needs only
            # the shards holding the tower
            self.where = {name: self.path / file for name, file in weight_map.items()}
        elif (self.path / SINGLE).is_file():
            self.listing = self.path / SINGLE
            with self._opened(self.path / SINGLE) as f:
                self.where = dict.fromkeys(f.keys(), self.path / SINGLE)
        else:
            raise UserError(f"{self.path}: no {SINGLE} or {INDEX} (only safetensors weights "
                            f"are read)")

    def add(self, file: Path) -> None:
        """Also read the tensors of the safetensors ``file`` (a part saved beside the
        checkpoint: an exported tower's projector)."""
        with self._opened(file) as f:
            self.where.update(dict.fromkeys(f.keys(), file))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        with self._opened(self._file(name)) as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Tensor ``name``, checked against ``shape`` (when given) before its data is read."""
        file = self._file(name)
        with self._opened(file) as f:
            have = tuple(f.get_slice(name).get_shape())
            if shape is not None and have != tuple(shape):
                raise UserError(f"{file}: tensor {name} has shape {list(have)}, expected "
                                f"{list(shape)} (from {CONFIG})")
            return f.get_tensor(name)  # a copy: the file's mapping goes when ``f`` closes

    def prefix(self, candidates: tuple[str, ...], probe: str) -> str:
        """The first of the candidate name prefixes under which the checkpoint holds
        ``probe`` (checkpoints of one model name its parts differently across versions)."""
        for prefix in candidates:
            if prefix + probe in self.where:
                return prefix
        raise UserError(f"{self.listing}: no tensor {candidates[0]}{probe} (nor "
                        f"{', '.join(p + probe for p in candidates[1:]) or 'another name'})")

    def _file(self, name: str) -> Path:
        if name not in self.where:
            raise UserError(f"{self.listing}: no tensor {name} (expected by {CONFIG}'s "
                            f"architecture)")
        file = self.where[name]
        if not file.is_file():
            raise UserError(f"{file}: missing shard (holds tensor {name}, by {INDEX})")
        return file

    @staticmethod
    def _opened(file: Path):
        """The file opened for one read: safetensors maps it, and the pages of a mapping
        held open count in the process's memory as they are read, which over a whole
        import would add up to the checkpoint's size."""
        from safetensors import safe_open

        try:
            return safe_open(str(file), framework="pt")
        except Exception as e:  # noqa: BLE001 -- a damaged file: one line
            raise UserError(f"{file}: not a readable safetensors file "
                            f"({str(e).splitlines()[0]})") from None


def read_config(path: str | Path) -> dict:
    """A checkpoint directory's ``config.json`` (no weights looked at)."""
    return _read_json(Path(path) / CONFIG)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: expected a JSON object")
    return value


def write_checkpoint_dir(out: str | Path, config: dict, tensors: Iterable[tuple[str, torch.Tensor]],
                         extra_files: Iterable[Path] = (), shard_bytes: int = SHARD_BYTES) -> Path:
    """Write ``config.json``, the tensors (in order, into shards of at most ``shard_bytes``;
    one shard is ``model.safetensors``, more are indexed) and copies of ``extra_files`` (a
    tokenizer's; directories whole) into ``out``, which must not exist yet. Returns ``out``."""
    from safetensors.torch import save_file

    with new_directory(out) as tmp:
        shards: list[list[str]] = [[]]
        pending: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            save_file(pending, str(tmp / f"shard-{len(shards) - 1}"), metadata={"format": "pt"})
            pending.clear()

        for name, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if pending and size + nbytes > shard_bytes:
                flush()
                shards.append([])
                size = 0
            pending[name] = tensor.detach().cpu().clone()  # no shared storage
            shards[-1].append(name)
            size += nbytes
            total += nbytes
        flush()
        _name_shards(tmp, shards, total)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for file in extra_files:  # a directory (a tower's checkpoint) is copied whole
            copy = shutil.copytree if Path(file).is_dir() else shutil.copy2
            copy(file, tmp / Path(file).name)
    return Path(out)


@contextlib.contextmanager
def new_directory(out: str | Path):
    """A directory for ``out`` (which must not exist) to be written in: ``out.partial``,
    renamed to ``out`` when the block ends, removed if it fails -- never half an output."""
    out = Path(out)
    if out.exists():
        raise UserError(f"{out}: already exists (give a new directory)")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _name_shards(tmp: Path, shards: list[list[str]], total: int) -> None:
    """The shards under their Hugging Face names, and the index when there are several."""
    if len(shards) == 1:
        os.replace(tmp / "shard-0", tmp / SINGLE)
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(tmp / f"shard-{i}", tmp / file)
        weight_map.update(dict.fromkeys(names, file))
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": weight_map}, indent=2) + "\n")
