"""One tiny demo for the pipeline tests of every module (building it takes seconds)."""

from __future__ import annotations

import pytest
from decode_fixtures import build_demo
from pipeline_fixtures import all_modalities_spec


@pytest.fixture(scope="session")
def pipeline_demo(tmp_path_factory):
    """The demo's directory; ``all.yaml`` mixes every source from step 0."""
    root = tmp_path_factory.mktemp("pipeline")
    build_demo(root)
    all_modalities_spec(root / "demo")
    return root / "demo"
