"""Indexing and decoding never import torch (issue #43 item 9): ``omniscale data index`` and
every Ray decoding actor would pay seconds for an import they do not use. Decoding yields
numpy; tensors are made where a micro-batch is packed (``loaders.collate``).

Each module is imported alone, in a fresh interpreter: one that imports torch, directly or
through anything it imports, fails here by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# ``omniscale data index`` (tools/data_cli.py imports loaders.index) and its Ray path
INDEX_MODULES = ["index", "index_ray", "shard_index", "text_cost", "features", "chat", "probe"]
# what a worker imports to decode a sample
DECODE_MODULES = ["decode", "decode_text", "decode_image", "decode_video", "decode_audio",
                  "pixels", "sequence", "token_ids", "readers"]
# What a Ray decoding actor imports: Ray ships loaders.ray_loaders.SourceDecoder by value, so
# the actor loads what its methods use -- loaders.worker's TimedDecoder and the decoders above.
# (The pool's workers collate and pack tensors: loaders.chunk_worker, not here.)
ACTOR_MODULES = ["worker"]


@pytest.mark.parametrize("module", INDEX_MODULES + DECODE_MODULES + ACTOR_MODULES)
def test_module_imports_without_torch(module):
    probe = (f"import sys; import omniscale.loaders.{module}; "
             "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
             "assert not loaded, loaded[:3]")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"omniscale.loaders.{module}: {done.stderr[-1500:]}"
