"""Text -> token ids with the dataset's ``tokenizer.json``, exactly as the index counted them.

The index (``loaders.text_cost``) encodes with ``add_special_tokens=False`` and counts media
markers as single tokens; the decoder must encode the same way, or the plane's token budgets
would not hold for the batches it planned.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omniscale.errors import UserError
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, SpecialTokens
from omniscale.loaders.probe import Corrupt, decode_text

# A text member is one sample's caption or document; anything larger is no training text and
# would stall a worker in the tokenizer.
MAX_TEXT_BYTES = 64 << 20


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer and the ids the sequence layout needs."""

    tokenizer: object  # tokenizers.Tokenizer
    pad_id: int
    eos_id: int
    marker_ids: dict[str, int]  # media kind -> id of its marker (``<image>`` …)
    special: SpecialTokens = DEFAULT_SPECIAL_TOKENS  # the names of those tokens

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int64) of ``text``; markers stay single tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)


def load_tokenizer(path: str | Path, special: SpecialTokens = DEFAULT_SPECIAL_TOKENS
                   ) -> TextTokenizer:
    """The tokenizer at ``path``, parsed once per process (a real one takes a while), with
    the ids of ``special``'s tokens (the mixing spec's ``special_tokens``).

    UserError when the file is unreadable or lacks one of the special tokens.
    """
    return _load_tokenizer(str(Path(path).resolve()), special)


@functools.lru_cache(maxsize=8)
def _raw_tokenizer(path: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 -- the tokenizers library raises bare Exceptions
        raise UserError(f"{path}: not a readable tokenizer ({' '.join(str(e).split())})"
                        ) from None


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, special: SpecialTokens) -> TextTokenizer:
    tokenizer = _raw_tokenizer(path)
    ids = {}
    for role, token in zip(("pad", "eos", *special.markers), special.names()):
        ids[token] = tokenizer.token_to_id(token)
        if ids[token] is None:
            raise UserError(f"{path}: has no token {token!r} (special_tokens.{role}: name a "
                            "token of this tokenizer, or add it: `omniscale model import-hf` "
                            "adds the defaults)")
    return TextTokenizer(tokenizer, ids[special.pad], ids[special.eos],
                         {kind: ids[marker] for kind, marker in special.markers.items()},
                         special)


def tokenizer_size(path: str | Path) -> int:
    """How many ids the tokenizer at ``path`` has (added tokens included)."""
    return _raw_tokenizer(str(Path(path).resolve())).get_vocab_size(with_added_tokens=True)


def text_of(data: bytes) -> str:
    """A text member's string: strict UTF-8 and bounded; :class:`Corrupt` otherwise."""
    if len(data) > MAX_TEXT_BYTES:
        raise Corrupt(f"text of {len(data)} bytes is above the {MAX_TEXT_BYTES} a decoder reads")
    return decode_text(data)


def tokenize(data: bytes, tokenizer: TextTokenizer) -> tuple[str, np.ndarray]:
    """(text, token ids) of a text member's bytes."""
    text = text_of(data)
    return text, tokenizer.encode(text)
