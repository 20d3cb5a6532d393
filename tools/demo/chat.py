"""The ``chat`` source: multi-turn conversations about one of the demo's images, clips or sounds.

Each sample is one medium drawn as its caption source draws it (``image``, ``video``, ``audio``)
and a conversation in the form ``omniscale data import`` writes (``loaders.conversation``):
``KEY.json`` holds ``{"messages": [...], "labels": {...}}``, the medium is ``KEY.0.<ext>``.
The first user turn carries the medium and asks for a description (the caption); one to three
follow-ups ask about single facts the pixels or tones decide -- how many shapes, the background,
what sits at a position, which way a shape moves, the rhythm. Every answer is a pure function
of the labels, so the fine-tuning demo's held-out answer accuracy measures grounding, not
memory: the eval split draws other media.
"""

from __future__ import annotations

import json

import numpy as np

from omniscale.tools.demo import audio, image, scenes, video

COUNTS = {1: "one", 2: "two", 3: "three"}


def _image(rng: np.random.Generator) -> tuple[str, str, bytes, list[tuple[str, str]], dict]:
    labels, ext, data = image.render(rng, hi=256)
    shapes = labels["shapes"]
    facts = [("How many shapes are there?", f"{COUNTS[len(shapes)]}."),
             ("What colour is the background?", f"{labels['background']}.")]
    one = shapes[int(rng.integers(len(shapes)))]
    where = "in the center" if one["position"] == "center" else f"at the {one['position']}"
    facts.append((f"What is {where}?", f"a {one['size']} {one['color']} {one['shape']}."))
    return "image", ext, data, [("Describe the picture.", scenes.image_caption(labels))] + \
        facts, labels


def _video(rng: np.random.Generator):
    labels, frames = video.render(rng)
    facts = [("Which way does it move?", f"{labels['direction']}."),
             ("What colour is the shape?", f"{labels['color']}."),
             ("What colour is the background?", f"{labels['background']}.")]
    return "video", "mp4", video.encode_mp4(frames, video.FPS), \
        [("What happens in the clip?", scenes.video_caption(labels))] + facts, labels


def _audio(rng: np.random.Generator):
    labels, ext, data = audio.render(rng)
    facts = [("Is it fast or slow?", f"{labels['rhythm']}."),
             ("How many notes repeat?", f"{COUNTS.get(len(labels['notes']), 'four')}."),
             ("What is the first note?", f"{labels['notes'][0]}.")]
    return "audio", ext, data, [("What do you hear?", audio.caption(labels))] + facts, labels


MEDIA = (_image, _video, _audio)


def sample(rng: np.random.Generator) -> tuple[list[tuple[str, bytes]], list[str]]:
    """Members (suffix, bytes) of one conversation sample, and its text for the tokenizer."""
    kind, ext, data, turns, labels = MEDIA[int(rng.integers(len(MEDIA)))](rng)
    opening, facts = turns[0], turns[1:]
    chosen = [facts[int(i)] for i in rng.permutation(len(facts))[:int(rng.integers(1, 4))]]
    messages = [{"role": "user", "content": [{"type": kind},
                                             {"type": "text", "text": opening[0]}]},
                {"role": "assistant", "content": [{"type": "text", "text": opening[1]}]}]
    for question, answer in chosen:
        messages += [{"role": "user", "content": [{"type": "text", "text": question}]},
                     {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    body = {"messages": messages, "labels": {"kind": kind, **labels}}
    members = [("json", json.dumps(body, sort_keys=True).encode()), (f"0.{ext}", data)]
    return members, [text for turn in (opening, *chosen) for text in turn]
