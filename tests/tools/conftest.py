"""The trainer tests read the suite's shared demo (tests/conftest.py); a test that damages
data makes its own copy."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo(demo_root):
    return demo_root
