"""The generated reference pages (``tools/reference_docs.py``) are what the code says now, and
they say what the code does."""

from __future__ import annotations

import re

from omniscale.tools import reference_docs
from omniscale.tools.train.config import RunConfig


def test_the_committed_pages_are_current():
    stale = [str(path.relative_to(reference_docs.ROOT)) for path, text in
             reference_docs.pages().items() if not path.is_file() or path.read_text() != text]
    assert not stale, f"{stale}: run python -m omniscale.tools.reference_docs"


def _keys(model, prefix=""):
    """Every dotted key of a config class, walked apart from the generator (an oracle)."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if hasattr(type(value), "model_fields"):
            yield from _keys(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_config_key_is_listed_once_with_its_default():
    page = reference_docs.config_reference()
    listed = re.findall(r"^- \*\*`([^`]+)`\*\* \(.*?; default (`[^`]*`)\)", page, re.M)
    keys = dict(listed)
    assert len(keys) == len(listed)  # no key twice
    config = RunConfig()
    for key in _keys(config):
        assert key in keys, key
        value = config
        for part in key.split("."):
            value = getattr(value, part)
        shown = f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"
        assert keys[key] == shown, (key, keys[key], shown)


def test_every_key_has_a_description():
    page = reference_docs.config_reference()
    bare = [line for line in page.splitlines() if line.startswith("- **") and "): " not in line]
    assert not bare, f"{len(bare)} keys without a comment in tools/train/config.py: {bare[:3]}"


def test_a_comment_in_the_code_is_the_description():
    page = reference_docs.config_reference()
    # the comment above data.window_bytes-like fields and an end-of-line one (config.py)
    assert re.search(r"^- \*\*`data.workers`\*\* .*: decode processes per rank", page, re.M)
    assert re.search(r"^- \*\*`steps`\*\* \(`int`, >= 1; default `100`\)", page, re.M)


def test_every_command_has_its_help():
    page = reference_docs.cli_reference()
    for command in ("omniscale train", "omniscale data index", "omniscale plane serve",
                    "omniscale model export-hf", "omniscale bench all"):
        assert f"## `{command}`" in page, command
    assert "--resume RUN_DIR" in page and "--global-batch-tokens" in page
