"""LLaVA format: ``{"id": ..., "image": "coco/train2017/1.jpg", "conversations": [...]}``.

The conversations are ShareGPT's (``from``: ``human`` / ``gpt``, ``<image>`` marking where the
image goes; no marker puts it at the start of the first human turn). ``image`` is one
reference or a list (LLaVA-OneVision), and LLaVA-Video's ``video`` is read the same way. Image
paths are usually relative to an image folder: pass it as ``--media-root``.
"""

from __future__ import annotations

from omniscale.loaders.importers.form import Conversation
from omniscale.loaders.importers.sharegpt import parse_turns

FIELDS = {"image": ("image",), "video": ("video",)}


def parse(record: object) -> Conversation:
    return parse_turns(record, FIELDS)
