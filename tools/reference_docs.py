"""The generated reference pages: every key of the run config (``docs/reference/config.md``),
every command of the CLI (``docs/reference/cli.md``), the benchmarks page
(``docs/benchmarks.md``, from the committed bench JSONs: tools/bench/docs_page.py) and the
mutation table of the testing page (``docs/testing.md``, from docs/bench/mutation.json:
tools/bench/mutation_table.py), written from the code and the data so they cannot drift.

    python -m omniscale.tools.reference_docs            # write the pages
    python -m omniscale.tools.reference_docs --check    # exit 1 naming a page that is stale

A config key's description is the comment the code gives it in ``tools/train/config.py`` (the
comment lines just above the field and the one at the end of its line), its type the field's
annotation as written there, its default the value a config without the key gets. A command's
page is its ``--help``, formatted at a fixed width. ``tests/test_reference_docs.py`` fails when
a committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import os
import sys
import tokenize
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"config": ROOT / "docs" / "reference" / "config.md",
         "cli": ROOT / "docs" / "reference" / "cli.md",
         "benchmarks": ROOT / "docs" / "benchmarks.md",
         "testing": ROOT / "docs" / "testing.md"}  # only its mutation table is generated
HELP_WIDTH = 100  # argparse wraps help at the terminal's width: fixed, so the page is stable


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line (without ``#``)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _fields_of(cls: type[BaseModel]) -> dict[str, tuple[str, str]]:
    """Field name -> (annotation as written, description from comments) of a config class."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments = _comments(source)
    out = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1  # 1-based: the line before the field
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        after = comments.get(node.end_lineno)
        text = " ".join(above + ([after] if after else []))
        out[node.target.id] = (ast.unparse(node.annotation), text)
    return out


def _default(value) -> str:
    if value is PydanticUndefined:
        return "none: required"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _bounds(field) -> str:
    """A field's numeric bounds (``Field(gt=0)`` ...) in words."""
    names = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "length >=",
             "max_length": "length <="}  # annotated_types' attribute names
    out = []
    for meta in field.metadata:
        for attr, word in names.items():
            if getattr(meta, attr, None) is not None:
                out.append(f"{word} {getattr(meta, attr)}")
    return ", ".join(out)


def _model_of(annotation) -> tuple[type[BaseModel] | None, bool]:
    """The config class a field holds -- a section, an optional one, or the items of a list of
    them -- and whether it is a list."""
    listed = getattr(annotation, "__origin__", None) is list
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate, listed
    return None, False


def _section(cls: type[BaseModel], instance, prefix: str, out: list[str]) -> None:
    written = _fields_of(cls)
    nested = []
    rows = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        annotation, text = written.get(name, (str(field.annotation), ""))
        model, listed = _model_of(field.annotation)
        value = getattr(instance, name) if instance is not None else field.get_default(
            call_default_factory=True)
        if model is not None and isinstance(value, BaseModel):
            nested.append((model, value, f"{key}.", text))
            continue
        bounds = _bounds(field)
        kind = f"`{annotation}`" + (f", {bounds}" if bounds else "")
        default = _default(value)
        rows.append(f"- **`{key}`** ({kind}; default {default}){': ' + text if text else ''}")
        if model is not None:  # a list of sections, or one that is off by default
            nested.append((model, None, f"{key}[]." if listed else f"{key}.", ""))
    out += rows
    for model, value, key_prefix, text in nested:
        out += ["", f"## `{key_prefix.rstrip('.')}`", ""]
        if text:
            out += [text, ""]
        doc = inspect.getdoc(model)
        if doc and model.__doc__:
            out += [" ".join(doc.split()), ""]
        _section(model, value, key_prefix, out)


def config_reference() -> str:
    from omniscale.tools.train.config import RunConfig

    out = ["# Run configuration reference", "",
           "<!-- generated by `python -m omniscale.tools.reference_docs`: do not edit -->", "",
           "Every key of the YAML file `omniscale train CONFIG.yaml` reads (also settable with",
           "`--set dotted.key=value`, the value parsed as YAML). An unknown key, or a value of",
           "the wrong type or out of bounds, stops the run with one line naming the file and",
           "the key. Defaults marked `None` that depend on the device are filled in at start",
           "(`deterministic`, `log_every`).", "", "## Top level", ""]
    _section(RunConfig, RunConfig(), "", out)
    return "\n".join(out).rstrip() + "\n"


def _commands(parser: argparse.ArgumentParser, path: list[str]):
    """(command words, parser) of every command, depth first."""
    yield path, parser
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + [name])


def cli_reference() -> str:
    from omniscale.tools.cli import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_WIDTH)
    try:
        out = ["# Command-line reference", "",
               "<!-- generated by `python -m omniscale.tools.reference_docs`: do not edit -->",
               "", "Every `omniscale` command with its `--help`.", ""]
        for path, parser in _commands(build_parser(), ["omniscale"]):
            out += [f"## `{' '.join(path)}`", "", "```text", parser.format_help().rstrip(),
                    "```", ""]
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(out).rstrip() + "\n"


def testing_page() -> str:
    """docs/testing.md as written by hand, its mutation table from docs/bench/mutation.json."""
    import json

    from omniscale.tools.bench.mutation_table import fill

    report = ROOT / "docs" / "bench" / "mutation.json"
    return fill(PAGES["testing"].read_text(),
                json.loads(report.read_text()) if report.is_file() else None)


def pages() -> dict[Path, str]:
    from omniscale.tools.bench.docs_page import benchmarks_page

    return {PAGES["config"]: config_reference(), PAGES["cli"]: cli_reference(),
            PAGES["benchmarks"]: benchmarks_page(), PAGES["testing"]: testing_page()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a committed page differs")
    args = parser.parse_args(argv)
    stale = []
    for path, text in pages().items():
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        print(f"{path.relative_to(ROOT)}: stale; run python -m omniscale.tools.reference_docs",
              file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
