"""The tiny demo, generated and indexed once per session for the trainer tests (they only read
it; a test that damages data makes its own copy)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    from omniscale.loaders.index import index_paths
    from omniscale.tools.demo import generate

    root = tmp_path_factory.mktemp("train-demo") / "demo"
    generate(root, scale="tiny", progress=False)
    index_paths([root / "mix.yaml", root / "eval.yaml"], progress=False)
    return root
