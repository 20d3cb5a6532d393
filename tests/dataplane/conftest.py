"""Fixtures shared by the data-plane tests."""

from __future__ import annotations

import pytest

from tests.demo_data import copy_demo


@pytest.fixture(scope="module")
def demo(demo_root, tmp_path_factory):
    """The indexed tiny demo, one copy per test module (tests may add specs to it)."""
    return copy_demo(demo_root, tmp_path_factory.mktemp("plane") / "demo")


@pytest.fixture
def root(tmp_path):
    """A spec's directory: a tokenizer and two local source directories (test_spec*)."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    for name in ("text", "docs"):
        (tmp_path / "train" / name).mkdir(parents=True)
    return tmp_path
