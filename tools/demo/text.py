"""Real text this machine already has: the standard library's Python sources and pydoc topics.

- ``text`` source: stdlib ``.py`` files, chosen by the seed, split into parts of at most
  ``PART_CHARS`` characters at line boundaries. Lengths keep their natural long tail (a few
  bytes to 256 KiB). Members ``KEY.txt`` and ``KEY.json`` ({"path", "part", "parts"}).
- ``docs`` source (Parquet): one row per pydoc topic, all of them at every scale.
- filler prose for interleaved documents: snippets of pydoc topics.
"""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import numpy as np

from omniscale.layout import SPECIAL_TOKENS

PART_CHARS = 256 * 1024  # keeps all but the largest few files whole: a real tail
SKIP_DIRS = frozenset({"__pycache__", "site-packages"})


def neutralize(text: str) -> str:
    """Break up special tokens (``<image>``, ``<eos>``…) in found text: in a text-only sample
    a media marker would point at media that does not exist."""
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "< " + token[1:])
    return text


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative paths of the stdlib's ``.py`` files, sorted, skipping caches and site-packages."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                  if not SKIP_DIRS.intersection(p.relative_to(root).parts))


def split_parts(text: str, limit: int = PART_CHARS) -> list[str]:
    """Consecutive pieces of at most ``limit`` characters, cut after a newline where one
    exists; joined they give back ``text``."""
    parts = []
    while len(text) > limit:
        cut = text.rfind("\n", 0, limit) + 1 or limit
        parts.append(text[:cut])
        text = text[cut:]
    parts.append(text)
    return parts


def choose_files(seed: int, stream: int,
                 counts: dict[str, int]) -> dict[str, list[tuple[str, str]]]:
    """Disjoint sets of stdlib files per split, ``counts[split]`` files each (fewer if the
    stdlib runs out), as (relative path, text). Files that are empty or not valid UTF-8 are
    skipped. Splits are filled in the order of ``counts``, from one seeded permutation."""
    if not counts:
        return {}
    root = stdlib_root()
    files = stdlib_files(root)
    order = np.random.default_rng([seed, stream]).permutation(len(files))
    chosen: dict[str, list[tuple[str, str]]] = {split: [] for split in counts}
    splits = iter(counts.items())
    split, want = next(splits)
    for i in order:
        while len(chosen[split]) >= want:
            nxt = next(splits, None)
            if nxt is None:
                return chosen
            split, want = nxt
        try:
            text = (root / files[i]).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            chosen[split].append((files[i], neutralize(text)))
    return chosen


def text_samples(files: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    """(text, provenance) per sample: every file split into parts."""
    samples = []
    for path, text in files:
        parts = split_parts(text)
        samples += [(part, {"path": path, "part": j, "parts": len(parts)})
                    for j, part in enumerate(parts)]
    return samples


def text_members(text: str, meta: dict) -> list[tuple[str, bytes]]:
    return [("txt", text.encode()), ("json", json.dumps(meta, sort_keys=True).encode())]


def topics() -> list[tuple[str, str]]:
    """(key, text) for every pydoc topic, sorted by name; keys use only [A-Za-z0-9_-]."""
    from pydoc_data.topics import topics as pydoc_topics

    rows, seen = [], set()
    for name in sorted(pydoc_topics):
        key = re.sub(r"[^A-Za-z0-9_-]", "_", name)
        while key in seen:  # two names that sanitize alike keep distinct keys
            key += "_"
        seen.add(key)
        rows.append((key, neutralize(pydoc_topics[name])))
    return rows


def filler(rng: np.random.Generator, docs: list[tuple[str, str]], min_chars: int = 120,
           max_chars: int = 600) -> tuple[str, str]:
    """A snippet of prose from a random topic: (topic key, one paragraph of whole words)."""
    key, text = docs[int(rng.integers(len(docs)))]
    words = text.split()
    n_chars = int(rng.integers(min_chars, max_chars + 1))
    start = int(rng.integers(max(1, len(words) - n_chars // 6)))
    out, size = [], 0
    for word in words[start:]:
        if size >= n_chars:
            break
        out.append(word)
        size += len(word) + 1
    return key, " ".join(out)
