"""Mixing specs (docs/mixing-spec.md): load, validate, and resolve a ``mix.yaml``.

Validation happens once, on load, so every later stage (index, plane, trainer) can trust the
spec. Structure and types are checked by pydantic models; rules that span fields (weights name
known sources, segments tile the axis, paths exist) are checked by hand. Either way the user
sees exactly one line, ``<file>: <field path>: <what is wrong>``, as a :class:`SpecError`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from omniscale.dataplane.schedule import KINDS, Schedule, ScheduleError, Segment
from omniscale.errors import UserError
from omniscale.geometry import MediaGeometry
from omniscale.layout import FORMATS, TEMPLATES, SpecialTokens
from omniscale.location import Location, check_storage_options, is_url

Accounting = Literal["samples", "tokens", "target_tokens"]
OnExhausted = Literal["next_epoch", "stop", "drop_source"]
NAME_PATTERN = r"^[A-Za-z0-9_-]+$"


class SpecError(UserError):
    """A mixing spec that breaks a rule; the message is one line naming file and field."""


@dataclass(frozen=True)
class SourceSpec:
    name: str
    path: Path | str  # absolute local path (a Path) or an fsspec URL (a str)
    format: str
    template: str
    on_exhausted: str  # the source's own value, or the spec's
    # a conversation source's template (``loaders.chat.chat_format`` reads it) and whether its
    # prompts are targets too; None for every other template
    chat_template: str | None = None
    train_on_prompt: bool = False
    storage_options: dict | None = None  # fsspec options for a URL path (no credentials)
    index_dir: str | None = None  # where its ``_index.parquet`` lives, when not beside it

    @property
    def location(self) -> Location:
        """Where the shards are, with the options to reach them."""
        return Location.of(self.path, self.storage_options)

    @property
    def index(self) -> Location:
        """Where the index is: beside the shards, or the spec's ``index_dir``/<name>."""
        if self.index_dir is None:
            return self.location
        return Location.of(self.index_dir, self.storage_options).join(self.name)


@dataclass(frozen=True)
class MixSpec:
    path: Path  # the spec file as given
    root: Path  # absolute directory that relative paths in the spec are resolved against
    seed: int
    tokenizer: Path  # absolute
    accounting: str
    on_exhausted: str
    media: MediaGeometry
    sources: tuple[SourceSpec, ...]
    schedule: Schedule
    special_tokens: SpecialTokens = SpecialTokens()  # the tokenizer's pad, eos, markers

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    @property
    def locations(self) -> dict[str, Location]:
        """Source name -> where its shards are (what a loader reads)."""
        return {s.name: s.location for s in self.sources}

    @property
    def indexes(self) -> dict[str, Location]:
        """Source name -> where its index is (the plane and the token ids read it)."""
        return {s.name: s.index for s in self.sources}


# --- structure: pydantic models mirroring the YAML -------------------------------------------

Number = Annotated[float, Field(allow_inf_nan=False)]
Weights = dict[str, float]  # values checked by Schedule, which knows the field paths


class _Strict(BaseModel):
    # strict: YAML already gives typed scalars, so "3" or true where a number belongs is a
    # mistake to report rather than coerce.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _SourceModel(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    path: str = Field(min_length=1)
    format: Literal[FORMATS]  # type: ignore[valid-type]
    template: Literal[TEMPLATES]  # type: ignore[valid-type]
    on_exhausted: OnExhausted | None = None
    weight: Number | None = Field(default=None, ge=0)
    # conversation sources only: chatml, tokenizer (its tokenizer_config.json's), or a .jinja
    chat_template: str | None = Field(default=None, min_length=1)
    train_on_prompt: bool | None = None  # conversation sources: targets beyond the assistant's
    storage_options: dict[str, Any] | None = None  # fsspec options of a URL path


class _SegmentBase(_Strict):
    start: Number = Field(ge=0)


class _Const(_SegmentBase):
    kind: Literal["const"]
    end: Number | None = None
    weights: Weights


class _Ramp(_SegmentBase):
    end: Number | None = None  # required; Schedule says so with the segment's kind
    from_: Weights = Field(alias="from")
    to: Weights


class _Linear(_Ramp):
    kind: Literal["linear"]


class _Cosine(_Ramp):
    kind: Literal["cosine"]


class _Step(_SegmentBase):
    kind: Literal["step"]
    end: Number | None = None
    at: Number = Field(ge=0)
    from_: Weights = Field(alias="from")
    to: Weights


_AnySegment = Annotated[Union[_Const, _Linear, _Cosine, _Step], Field(discriminator="kind")]


class _ScheduleModel(_Strict):
    unit: Literal["steps", "tokens"] = "steps"
    segments: list[_AnySegment] = Field(min_length=1)


_MediaModel = create_model(
    "_MediaModel", __base__=_Strict,
    **{f.name: ({"int": int, "float": Number}[str(f.type)] | None, None)
       for f in fields(MediaGeometry)})


_SpecialTokensModel = create_model(
    "_SpecialTokensModel", __base__=_Strict,
    **{f.name: (str | None, Field(default=None, min_length=1)) for f in fields(SpecialTokens)})


class _SpecModel(_Strict):
    seed: int = Field(default=0, ge=0)
    tokenizer: str = Field(min_length=1)
    special_tokens: _SpecialTokensModel | None = None  # type: ignore[valid-type]
    accounting: Accounting = "tokens"
    on_exhausted: OnExhausted = "next_epoch"
    media: _MediaModel | None = None  # type: ignore[valid-type]
    sources: list[_SourceModel] = Field(min_length=1)
    schedule: _ScheduleModel | None = None
    index_dir: str | None = Field(default=None, min_length=1)  # indexes away from the data


# --- loading ---------------------------------------------------------------------------------

class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that rejects a key given twice (PyYAML would silently keep the last)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_spec(path: str | Path, check_paths: bool = True) -> MixSpec:
    """Read and validate a spec file; relative paths resolve against its directory.

    Raises :class:`SpecError` (one line, prefixed with ``path`` as given) for anything wrong,
    including a missing file or broken YAML.
    """
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{file}: file not found") from None
    except IsADirectoryError:
        raise SpecError(f"{file}: is a directory, not a spec file") from None
    except UnicodeDecodeError:
        raise SpecError(f"{file}: not UTF-8 text") from None
    except OSError as e:
        raise SpecError(f"{file}: cannot read ({e.strerror})") from None
    return spec_from_text(text, file, root=Path(os.path.abspath(path)).parent,
                          check_paths=check_paths)


def spec_from_text(text: str, file: str, *, root: Path, check_paths: bool = True) -> MixSpec:
    """A spec from its YAML text (read elsewhere: the plane reads with limits, or from its
    state dir's copy); ``file`` names it in errors, ``root`` anchors its relative paths."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise SpecError(f"{file}: {_yaml_problem(e)}") from None
    return parse_spec(data, file, root=root, check_paths=check_paths)


def parse_spec(data: Any, file: str = "mix.yaml", *, root: Path | None = None,
               check_paths: bool = True) -> MixSpec:
    """Validate an already-parsed spec; ``file`` names it in errors, ``root`` (default: the
    directory of ``file``) anchors its relative paths."""
    root = Path(os.path.abspath(root if root is not None else Path(file).parent))
    if data is None:
        raise SpecError(f"{file}: empty file (expected a mixing spec, see docs/mixing-spec.md)")
    if not isinstance(data, dict):
        raise SpecError(f"{file}: top level must be a mapping, got {_type_name(data)}")
    try:
        model = _SpecModel.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"{file}: {_pydantic_problem(e)}") from None
    try:
        return _build(model, file, root, check_paths)
    except ScheduleError as e:
        raise SpecError(f"{file}: schedule.{e}") from None


def _build(m: _SpecModel, file: str, root: Path, check_paths: bool) -> MixSpec:
    seen: dict[str, int] = {}
    for i, s in enumerate(m.sources):
        if s.name in seen:
            raise SpecError(f"{file}: sources[{i}].name: duplicate name {s.name!r} "
                            f"(also sources[{seen[s.name]}])")
        seen[s.name] = i
    tokenizer = _resolve(root, m.tokenizer)
    if check_paths and not tokenizer.is_file():
        raise SpecError(f"{file}: tokenizer: {m.tokenizer!r} does not exist")
    index_dir = None
    if m.index_dir is not None:
        index_dir = m.index_dir if is_url(m.index_dir) else str(_resolve(root, m.index_dir))
    sources = []
    for i, s in enumerate(m.sources):
        try:
            options = check_storage_options(s.storage_options,
                                            f"{file}: sources[{i}].storage_options")
        except UserError as e:
            raise SpecError(str(e)) from None
        if is_url(s.path):
            # Remote paths are not listed here: the indexer and the plane name a missing one.
            path: Path | str = s.path.rstrip("/")
        else:
            if options:
                raise SpecError(f"{file}: sources[{i}].storage_options: only for a URL path "
                                f"(s3://…, gs://…), this source is at {s.path!r}")
            path = _resolve(root, s.path.removeprefix("file://"))
            if check_paths and not path.is_dir():
                problem = "is not a directory" if path.exists() else "does not exist"
                raise SpecError(f"{file}: sources[{i}].path: {s.path!r} {problem}")
        sources.append(SourceSpec(s.name, path, s.format, s.template,
                                  s.on_exhausted or m.on_exhausted,
                                  _chat_template(s, i, file, root, check_paths),
                                  bool(s.train_on_prompt), options or None, index_dir))
    media_given = m.media.model_dump(exclude_none=True) if m.media is not None else {}
    try:
        media = MediaGeometry.from_dict(media_given)
    except ValueError as e:  # its messages already read "media.<field>: ..."
        raise SpecError(f"{file}: {e}") from None
    special = SpecialTokens(**(m.special_tokens.model_dump(exclude_none=True)
                               if m.special_tokens is not None else {}))
    if not special.distinct():
        raise SpecError(f"{file}: special_tokens: each role needs a token of its own, got "
                        f"{special.names()}")
    return MixSpec(path=Path(file), root=root, seed=m.seed, tokenizer=tokenizer,
                   accounting=m.accounting, on_exhausted=m.on_exhausted, media=media,
                   sources=tuple(sources), schedule=_schedule(m, file), special_tokens=special)


def _chat_template(s: _SourceModel, i: int, file: str, root: Path, check_paths: bool
                   ) -> str | None:
    if s.template != "conversation":
        for key in ("chat_template", "train_on_prompt"):
            if getattr(s, key) is not None:
                raise SpecError(f"{file}: sources[{i}].{key}: only for template: conversation "
                                f"(this source is {s.template})")
        return None
    if s.format == "parquet":
        raise SpecError(f"{file}: sources[{i}].format: a conversation source is webdataset "
                        "(media beside the messages) or jsonl (text only)")
    which = s.chat_template or "chatml"
    if which in ("chatml", "tokenizer"):  # (the tokenizer's config is read by the indexer)
        return which
    path = _resolve(root, which)
    if check_paths and not path.is_file():
        raise SpecError(f"{file}: sources[{i}].chat_template: {which!r} is not chatml, "
                        "tokenizer or an existing Jinja file")
    return str(path)


def _schedule(m: _SpecModel, file: str) -> Schedule:
    names = tuple(s.name for s in m.sources)
    weighted = [i for i, s in enumerate(m.sources) if s.weight is not None]
    if m.schedule is not None:
        if weighted:
            raise SpecError(f"{file}: sources[{weighted[0]}].weight: not allowed together with "
                            "a schedule (use one or the other)")
        segments = [Segment(s.kind, s.start, s.end,
                            s.weights if s.kind == "const" else s.from_,
                            s.weights if s.kind == "const" else s.to,
                            getattr(s, "at", None))
                    for s in m.schedule.segments]
        return Schedule(names, tuple(segments), m.schedule.unit)
    if not weighted:
        raise SpecError(f"{file}: schedule: required (or give every source a `weight`)")
    if len(weighted) < len(names):
        missing = next(i for i, s in enumerate(m.sources) if s.weight is None)
        raise SpecError(f"{file}: sources[{missing}].weight: required when other sources carry "
                        "a weight instead of a schedule")
    if not any(s.weight > 0 for s in m.sources):
        raise SpecError(f"{file}: sources: every weight is 0 (at least one must be > 0)")
    return Schedule.constant({s.name: s.weight for s in m.sources})


def _resolve(root: Path, p: str) -> Path:
    """Absolute, normalised (``..`` folded) but not symlink-resolved: the user's layout."""
    return Path(os.path.normpath(root / os.path.expanduser(p)))


# --- one-line messages -----------------------------------------------------------------------

def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = " ".join(str(getattr(e, "problem", None) or e).split())
    if mark is None:
        return f"invalid YAML: {problem}"
    return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _loc(loc: tuple) -> str:
    """``('schedule', 'segments', 2, 'const', 'weights')`` -> ``schedule.segments[2].weights``.

    Pydantic inserts the discriminator's tag after a union member's index; the user never wrote
    it, so it is dropped. A mapping key is written ``.key`` even when it is a number.
    """
    out = ""
    for i, part in enumerate(loc):
        if part == "[key]":  # pydantic's marker: the part before it is a mapping key
            continue
        if isinstance(part, int) and not (i + 1 < len(loc) and loc[i + 1] == "[key]"):
            out += f"[{part}]"
        elif i >= 2 and isinstance(loc[i - 1], int) and loc[i - 2] == "segments" and part in KINDS:
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _pydantic_problem(e: ValidationError) -> str:
    err = e.errors()[0]
    loc, kind, ctx, value = err["loc"], err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "union_tag_not_found":
        return f"{_loc(loc)}.kind: required (one of {', '.join(KINDS)})"
    if kind == "union_tag_invalid":
        return (f"{_loc(loc)}.kind: unknown kind {ctx.get('tag')!r} "
                f"(expected {', '.join(KINDS[:-1])} or {KINDS[-1]})")
    field = loc[-1] if loc else "value"
    messages = {
        "missing": lambda: "required",
        "extra_forbidden": lambda: "unknown key",
        "literal_error": lambda: f"unknown {field} {value!r} "
                                 f"(expected {_choices(ctx.get('expected', ''))})",
        "string_pattern_mismatch": lambda: f"must match [A-Za-z0-9_-]+, got {value!r}",
        "finite_number": lambda: f"must be finite, got {value}",
        "greater_than_equal": lambda: f"must be >= {_num(ctx.get('ge'))}, got {_num(value)}",
        "too_short": lambda: "must not be empty",
        "string_too_short": lambda: "must not be empty",
        "dict_type": lambda: f"must be a mapping, got {_type_name(value)}",
        "model_type": lambda: f"must be a mapping, got {_type_name(value)}",
        "model_attributes_type": lambda: f"must be a mapping, got {_type_name(value)}",
        "list_type": lambda: f"must be a list, got {_type_name(value)}",
        "string_type": lambda: f"must be a string, got {_type_name(value)}",
        "int_type": lambda: f"must be an integer, got {_type_name(value)}",
        "float_type": lambda: _number_problem(value),
    }
    problem = messages[kind]() if kind in messages else _generic(err)
    where = _loc(loc)
    return f"{where}: {problem}" if where else problem


def _number_problem(value: Any) -> str:
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value):
        # YAML 1.1 reads 1e9 as a string; 1.0e9 or 1_000_000_000 are numbers.
        return f"must be a number, got the string {value!r} (write 1.0e9 or 1_000_000_000)"
    return f"must be a number, got {_type_name(value)}"


def _generic(err: dict) -> str:
    msg = err["msg"]
    return " ".join((msg[:1].lower() + msg[1:]).split()) + f", got {_short(err.get('input'))}"


def _num(v: Any) -> str:
    """``0`` rather than ``0.0``: the user wrote integers."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _choices(expected: str) -> str:
    """Pydantic's ``'a', 'b' or 'c'`` without the quotes."""
    return expected.replace("'", "")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    names = {dict: "a mapping", list: "a list", str: "a string", int: "an integer",
             float: "a number"}
    name = names.get(type(value), type(value).__name__)
    return f"{name} {_short(value)}" if isinstance(value, (str, int, float)) else name


def _short(value: Any, limit: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."

