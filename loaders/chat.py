"""Conversations -> one text and the character spans the model is trained to produce.

A conversation source (``chat_template:`` on a source of the mixing spec) holds samples whose
``KEY.json`` member has ``messages``: ``[{role, content}]``, content a string or a list of
parts ``{"type": "text", "text": …}`` / ``{"type": "image"}`` / ``{"type": "video"}`` /
``{"type": "audio"}`` (the k-th image part is the sample's k-th image member, and so on).

Rendering is a Jinja chat template, as Hugging Face tokenizers carry them
(``tokenizer_config.json``'s ``chat_template``), or the built-in ``chatml``. Each message's
content is flattened to a string first: text parts as they are, each media part as its kind's
marker (``special_tokens``: ``<image>`` …), so the template puts the marker where the message
had the item and the sequence layout (``loaders.sequence``) expands it to the item's block.
The text equals transformers' ``apply_chat_template`` on the flattened messages.

Targets: by default only what each assistant message adds (``loaders.chat_turns``): what the
template's ``{% generation %}`` blocks render, Hugging Face's assistant mask, when it has them;
otherwise each assistant turn from the end of the generation prompt before it to its end of
turn, found also when the template renders the last turn differently from earlier ones
(Qwen3's reasoning). A sample whose turns still cannot be told apart is refused with the
reason. ``train_on_prompt`` makes the whole text a target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omniscale.errors import UserError
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, SpecialTokens
from omniscale.loaders.chat_turns import assistant_spans, render_text
from omniscale.loaders.probe import Corrupt

# ChatML (Qwen's turn format): every turn, its role, its content, an end-of-turn token.
CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")  # a tokenizer for chatml should have them
BUILTIN = {"chatml": CHATML}
TOKENIZER = "tokenizer"  # the template of the tokenizer's own tokenizer_config.json
ROLES = ("system", "user", "assistant")
MEDIA_PARTS = ("image", "video", "audio")


@dataclass(frozen=True)
class ChatFormat:
    """How a source's conversations become text: the template's Jinja source, where it came
    from (``chatml``, ``tokenizer``, a file), and whether the prompt is trained on too."""

    template: str
    name: str = "chatml"
    train_on_prompt: bool = False
    bos_token: str = ""
    eos_token: str = ""

    def to_dict(self) -> dict:
        return {"template": self.template, "name": self.name,
                "train_on_prompt": self.train_on_prompt, "bos_token": self.bos_token,
                "eos_token": self.eos_token}

    @classmethod
    def from_dict(cls, d: dict) -> "ChatFormat":
        return cls(**d)


def chat_format(which: str, tokenizer: Path, train_on_prompt: bool = False) -> ChatFormat:
    """``chatml``, ``tokenizer`` (``tokenizer_config.json`` beside ``tokenizer``) or a path to
    a Jinja file; a UserError naming what is missing."""
    if which in BUILTIN:
        return ChatFormat(BUILTIN[which], which, train_on_prompt)
    if which == TOKENIZER:
        config_path = Path(tokenizer).parent / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"{config_path}: chat_template: tokenizer needs a readable "
                            f"tokenizer_config.json beside the tokenizer ({e})") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        # where transformers 4.43+ saves it; like transformers, it wins over the config's
        beside = config_path.parent / "chat_template.jinja"
        if beside.is_file():
            template = beside.read_text(encoding="utf-8")
        if not isinstance(template, str) or not template:
            raise UserError(f"{config_path}: no chat_template (name chatml or a .jinja file "
                            "instead)")
        return ChatFormat(template, TOKENIZER, train_on_prompt, _token(config, "bos_token"),
                          _token(config, "eos_token"))
    path = Path(which)
    try:
        return ChatFormat(path.read_text(encoding="utf-8"), str(which), train_on_prompt)
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: chat_template: not chatml, tokenizer or a readable Jinja "
                        f"file ({e.__class__.__name__})") from None


def _token(config: dict, key: str) -> str:
    value = config.get(key)
    if isinstance(value, dict):  # an AddedToken as saved by transformers
        value = value.get("content")
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class Rendered:
    """A conversation as text, and the [start, end) character spans that are targets."""

    text: str
    spans: tuple[tuple[int, int], ...]
    media: dict[str, int]  # media parts per kind, in the order the text marks them


def flatten(messages, special: SpecialTokens = DEFAULT_SPECIAL_TOKENS
            ) -> tuple[list[dict], dict[str, int]]:
    """Messages with string content (media parts as markers), and the media parts per kind;
    :class:`Corrupt` naming the message for anything not in the form above."""
    if not isinstance(messages, list) or not messages:
        raise Corrupt("'messages' is not a non-empty list")
    flat, media = [], dict.fromkeys(MEDIA_PARTS, 0)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise Corrupt(f"message {i}: not an object with a role of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            pieces = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                elif kind in MEDIA_PARTS:
                    pieces.append(special.markers[kind])
                    media[kind] += 1
                else:
                    raise Corrupt(f"message {i} part {j}: not a text, image, video or audio "
                                  "part")
            content = "".join(pieces)
        elif not isinstance(content, str):
            raise Corrupt(f"message {i}: content is neither a string nor a list of parts")
        flat.append({"role": message["role"], "content": content})
    return flat, media


def render(messages, chat: ChatFormat, special: SpecialTokens = DEFAULT_SPECIAL_TOKENS
           ) -> Rendered:
    """The conversation's text and target spans (module docstring); :class:`Corrupt` for a
    malformed conversation or one the template cannot split into turns."""
    flat, media = flatten(messages, special)
    if chat.train_on_prompt:
        text = render_text(chat, flat, False)
        return Rendered(text, ((0, len(text)),), media)
    text, spans = assistant_spans(chat, flat)
    return Rendered(text, spans, media)


def token_targets(offsets: list[tuple[int, int]], spans) -> list[tuple[int, int]]:
    """[start, end) token ranges whose tokens begin inside a target span (``offsets``: each
    token's character range, as the tokenizer reports it)."""
    ranges: list[tuple[int, int]] = []
    span_iter = iter(sorted(spans))
    span = next(span_iter, None)
    for t, (start, _) in enumerate(offsets):
        while span is not None and start >= span[1]:
            span = next(span_iter, None)
        if span is None:
            break
        if span[0] <= start < span[1]:
            if ranges and ranges[-1][1] == t:
                ranges[-1] = (ranges[-1][0], t + 1)
            else:
                ranges.append((t, t + 1))
    return ranges


def render_member(data: bytes, chat: ChatFormat, special: SpecialTokens = DEFAULT_SPECIAL_TOKENS
                  ) -> Rendered:
    """A ``KEY.json`` member's conversation, rendered; :class:`Corrupt` when it is no
    UTF-8 JSON object with ``messages``."""
    from omniscale.loaders.probe import decode_text

    try:
        obj = json.loads(decode_text(data))
    except ValueError as e:
        raise Corrupt(f"not JSON ({e})") from None
    if not isinstance(obj, dict) or "messages" not in obj:
        raise Corrupt("not an object with 'messages'")
    return render(obj["messages"], chat, special)


def targets_mask(ranges, n: int):
    """A bool array of ``n`` text tokens, True inside the [start, end) token ``ranges``
    (given flat, as the index keeps them, or as pairs)."""
    import numpy as np

    flat = np.asarray(ranges, dtype=np.int64).reshape(-1)
    mask = np.zeros(n, bool)
    for start, end in flat.reshape(-1, 2):
        mask[start:end] = True
    return mask
