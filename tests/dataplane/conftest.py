"""Fixtures shared by the data-plane tests."""

from __future__ import annotations

import pytest

from omniscale.loaders.index import index_paths
from omniscale.tools.demo import generate


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A real tiny demo dataset, indexed; one per test module (tests may add specs to it)."""
    out = tmp_path_factory.mktemp("plane") / "demo"
    generate(out, scale="tiny", progress=False)
    index_paths([out / "mix.yaml"], progress=False)
    return out
