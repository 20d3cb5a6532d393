"""The demo tokenizer: byte-level BPE trained on the demo's own text.

Trained on a bounded sample of the training text plus every caption, so every caption word is
in the vocabulary; the special tokens are :data:`omniscale.layout.SPECIAL_TOKENS`, so a
``<image>`` marker in text is one token, then ChatML's turn tokens (the ``chat`` source's
template).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from omniscale.loaders.chat import CHATML_TOKENS
from omniscale.layout import SPECIAL_TOKENS

VOCAB_SIZE = 8192
MAX_TEXT_BYTES = 4 * 1024 * 1024


def bounded(texts: list[str], max_bytes: int = MAX_TEXT_BYTES) -> list[str]:
    """The longest prefix of ``texts`` within ``max_bytes`` of UTF-8 (at least one text)."""
    out, size = [], 0
    for t in texts:
        size += len(t.encode())
        if out and size > max_bytes:
            break
        out.append(t)
    return out


def train_tokenizer(texts: list[str], captions: list[str], path: Path,
                    vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train on ``bounded(texts) + captions`` and save to ``path``.

    The result depends only on the input, in order: the trainer counts words and breaks ties
    between equally frequent merges deterministically.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS, *CHATML_TOKENS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(bounded(texts) + list(captions), trainer=trainer)
    tok.save(str(path))
    return tok
