"""How a sample is laid out in a source, and how it becomes one LLM sequence.

WebDataset convention: the members of one sample share a key (the member name up to its first
dot) and are contiguous in the tar. The rest of the name says what the member is:

- ``KEY.txt``: the sample's text (UTF-8). Media markers ``<image>``, ``<video>``, ``<audio>`` in
  it say where each media item goes (interleaved documents);
- ``KEY.json``: metadata (labels for evaluation, provenance) -- never tokenized;
- media: ``KEY.jpg`` / ``KEY.png`` / ``KEY.mp4`` / ``KEY.wav`` / ``KEY.flac`` …, or
  ``KEY.N.ext`` for several items, taken in order of ``N``.

Parquet and JSONL sources hold text only: a ``text`` field and an optional ``key``.

The LLM sequence of a sample is: a placeholder block for every media item the text does not
mark (caption samples: media first, then the caption), the text with every marker expanded to
the media item's placeholder block, then ``<eos>``. Hence the index's cost features:
``text_tokens`` = non-media tokens including ``<eos>``, and
``llm_tokens`` = ``text_tokens`` + the placeholder tokens of every media item.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

IGNORE_INDEX = -100  # the label the loss skips (media, the last token, padding); torch's default


@dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's tokens for the roles a sequence needs, one token each: padding, the end
    of a sample, and each media kind's marker -- the string that marks an item's place in a
    text, and the token that fills its placeholder block. A mixing spec names them
    (``special_tokens:``) for its tokenizer; the defaults are the demo tokenizer's."""

    pad: str = "<pad>"
    eos: str = "<eos>"
    image: str = "<image>"
    video: str = "<video>"
    audio: str = "<audio>"

    @property
    def markers(self) -> dict[str, str]:
        """Media kind -> its marker."""
        return {"image": self.image, "video": self.video, "audio": self.audio}

    def names(self) -> list[str]:
        return [self.pad, self.eos, self.image, self.video, self.audio]

    def distinct(self) -> bool:
        """Whether every role has a token of its own (a spec or a run naming two alike is
        refused)."""
        return len(set(self.names())) == len(self.names())


DEFAULT_SPECIAL_TOKENS = SpecialTokens()
SPECIAL_TOKENS = DEFAULT_SPECIAL_TOKENS.names()  # the demo tokenizer's special tokens

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif"})
VIDEO_EXTS = frozenset({"mp4", "webm", "mkv", "avi", "mov"})
AUDIO_EXTS = frozenset({"wav", "flac", "ogg", "mp3"})
TEXT_EXTS = frozenset({"txt"})
META_EXTS = frozenset({"json"})

FORMATS = ("webdataset", "parquet", "jsonl")
# conversation: a ``KEY.json`` member with ``messages`` (``loaders.chat``)
TEMPLATES = ("text", "image_caption", "video_caption", "audio_caption", "interleaved",
             "conversation")

_NUMBERED = re.compile(r"^(\d+)\.(.+)$")


def split_member_name(name: str) -> tuple[str, str]:
    """``dir/key.0.jpg`` -> (``dir/key``, ``0.jpg``): key up to the basename's first dot."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1:]


def member_kind(suffix: str) -> str | None:
    """``image``, ``video``, ``audio``, ``text``, ``meta``, or None for a member we ignore."""
    ext = suffix.rsplit(".", 1)[-1].lower()
    for kind, exts in (("image", IMAGE_EXTS), ("video", VIDEO_EXTS), ("audio", AUDIO_EXTS),
                       ("text", TEXT_EXTS), ("meta", META_EXTS)):
        if ext in exts:
            return kind
    return None


def media_order(suffix: str) -> tuple[int, str]:
    """Sort key that puts ``2.jpg`` before ``10.jpg`` and an unnumbered item first."""
    m = _NUMBERED.match(suffix)
    return (int(m.group(1)), suffix) if m else (-1, suffix)


def count_markers(text: str, special: SpecialTokens = DEFAULT_SPECIAL_TOKENS
                  ) -> dict[str, int]:
    return {kind: text.count(marker) for kind, marker in special.markers.items()}
