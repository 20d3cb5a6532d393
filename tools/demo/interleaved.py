"""The ``interleaved`` source: documents that mix prose and 2-4 images.

Members: ``KEY.txt`` with one ``<image>`` marker per image, in order, each followed by a
sentence describing that image, between snippets of pydoc prose; ``KEY.0.jpg``, ``KEY.1.png``,
… (numbered webdataset members, taken in order of the number); ``KEY.json`` ({"images": the
scene labels in order, "topics": the pydoc topics the prose came from}).
"""

from __future__ import annotations

import json

import numpy as np

from omniscale.layout import DEFAULT_SPECIAL_TOKENS
from omniscale.tools.demo import image, scenes, text

MIN_IMAGES, MAX_IMAGES = 2, 4
MIN_SIDE, MAX_SIDE = 64, 512  # smaller than caption images: a document holds several


def sample(rng: np.random.Generator,
           docs: list[tuple[str, str]]) -> tuple[list[tuple[str, bytes]], list[str]]:
    """Members (suffix, bytes) of one document, and its text for the tokenizer.

    ``docs`` are the pydoc topics (:func:`tools.demo.text.topics`), passed in so a shard
    loads them once.
    """
    n_images = int(rng.integers(MIN_IMAGES, MAX_IMAGES + 1))
    paragraphs, images, labels, topics = [], [], [], []
    for j in range(n_images):
        topic, prose = text.filler(rng, docs)
        topics.append(topic)
        scene, ext, data = image.render(rng, MIN_SIDE, MAX_SIDE)
        paragraphs += [prose, f"{DEFAULT_SPECIAL_TOKENS.image}\nFigure {j + 1} shows {scenes.image_caption(scene)}"]
        images.append((f"{j}.{ext}", data))
        labels.append(scene)
    if rng.random() < 0.5:
        topic, prose = text.filler(rng, docs)
        topics.append(topic)
        paragraphs.append(prose)
    document = "\n\n".join(paragraphs) + "\n"
    meta = {"images": labels, "topics": topics}
    members = [("txt", document.encode()), ("json", json.dumps(meta, sort_keys=True).encode())]
    return members + images, [document]
