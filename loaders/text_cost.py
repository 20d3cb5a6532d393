"""Text token counts for the index, with the dataset's own tokenizer.

``text_tokens`` (see ``omniscale.layout``) counts every token of the sequence that is not a media
placeholder, ``<eos>`` included: the text's tokens, minus the media markers (each becomes a
placeholder block accounted with its media item), plus one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from omniscale.errors import UserError
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, SpecialTokens

TOKENIZER_FILENAME = "tokenizer.json"


@dataclass(frozen=True)
class TokenCounter:
    """A loaded tokenizer and the ids of its media markers."""

    tokenizer: object  # tokenizers.Tokenizer
    marker_ids: frozenset[int]
    special: SpecialTokens = DEFAULT_SPECIAL_TOKENS
    loaded: object = None  # the decoders' decode_text.TextTokenizer (pad, eos, marker ids)

    @classmethod
    def from_file(cls, path: str | Path, special: SpecialTokens = DEFAULT_SPECIAL_TOKENS
                  ) -> "TokenCounter":
        """Load ``tokenizer.json`` (loaders.decode_text.load_tokenizer: the decoders' loader,
        so index and decoders agree); a UserError when it is unreadable or lacks the markers.

        The markers must be single tokens, or the count of non-media tokens would depend on
        how the tokenizer happens to split ``<image>``.
        """
        from omniscale.loaders.decode_text import load_tokenizer

        loaded = load_tokenizer(path, special)
        return cls(loaded.tokenizer, frozenset(loaded.marker_ids.values()), special, loaded)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, as the decoders encode it (``decode_text``)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encodings(self, texts: list[str]) -> list:
        """Each text's encoding as ``encode_batch`` makes it, with each token's character
        range (``.offsets``): a conversation's targets are character spans."""
        return self.tokenizer.encode_batch(texts, add_special_tokens=False)

    def count(self, ids: list[int]) -> int:
        """Non-media tokens of a text's ids, ``<eos>`` included."""
        return len(ids) - sum(i in self.marker_ids for i in ids) + 1


def tokenizer_fingerprint(path: str | Path) -> str:
    """sha256 of the tokenizer file: features are stale when it changes, whatever its mtime."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def find_tokenizer(source_dir: str | Path) -> Path:
    """The nearest ``tokenizer.json`` in the source directory or one of its parents."""
    start = Path(source_dir).resolve()
    for directory in (start, *start.parents):
        candidate = directory / TOKENIZER_FILENAME
        if candidate.is_file():
            return candidate
    raise UserError(f"{source_dir}: no {TOKENIZER_FILENAME} in it or its parents; pass "
                    "--tokenizer")
