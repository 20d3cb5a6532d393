"""The suite's one demo dataset: the tiny demo (seed 0), generated and indexed once per test
run by the session fixture ``demo_root`` (tests/conftest.py). Tests read it in place; a test or
module that writes beside it (a new spec, a damaged shard, an index of its own) works on a copy
from ``copy_demo``, so no test sees another's changes."""

from __future__ import annotations

import shutil
from pathlib import Path

from omniscale.index_schema import INDEX_FILENAME
from omniscale.loaders.index import index_paths
from omniscale.tools.demo import generate

SCALE = "tiny"
SEED = 0
# The demo's tokenizer has 8,192 tokens; a CPU training step of the tiny model then spends
# about 40% of its time in the LM head. The suite's demo takes 2,048: steps ~40% cheaper.
VOCAB_SIZE = 2048
# indexed: every source the demo's specs name (lm.yaml and video.yaml name a subset of mix.yaml's)
SPECS = ("mix.yaml", "eval.yaml", "sft.yaml", "sft_eval.yaml")


def build(root: Path) -> Path:
    generate(root, scale=SCALE, seed=SEED, progress=False, vocab_size=VOCAB_SIZE)
    index_paths([root / s for s in SPECS], progress=False)
    return root


def copy_demo(demo_root: Path, dest: Path, *, indexed: bool = True) -> Path:
    """A private copy of the demo at ``dest`` (file times kept, so its indexes stay fresh);
    ``indexed=False`` leaves the indexes out, as ``omniscale data demo`` writes it."""
    # never an index's temp file: another worker may be rewriting the shared demo's index while
    # this copies it (CI: copytree failed on `._index.parquet.PID.tmp` renamed away meanwhile);
    # the rename is atomic, so the copy gets the old index or the new one whole
    writing = f".{INDEX_FILENAME}.*.tmp"
    ignore = shutil.ignore_patterns(writing) if indexed else \
        shutil.ignore_patterns(INDEX_FILENAME, writing)
    shutil.copytree(demo_root, dest, ignore=ignore)
    return dest
