"""One copy of the demo for the pipeline tests of every module."""

from __future__ import annotations

import pytest

from tests.demo_data import copy_demo
from tests.loaders.pipeline_fixtures import all_modalities_spec


@pytest.fixture(scope="session")
def pipeline_demo(demo_root, tmp_path_factory):
    """A copy of the demo; its ``all.yaml`` mixes every source from step 0."""
    root = copy_demo(demo_root, tmp_path_factory.mktemp("pipeline") / "demo")
    all_modalities_spec(root)
    return root
