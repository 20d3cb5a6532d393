"""Which characters of a rendered conversation the model is trained to produce.

The text is always the template's one rendering of the whole conversation -- what
transformers' ``apply_chat_template`` gives, and what the model sees as history at inference.
The targets are found in it in one of two ways:

- **The template marks them**: ``{% generation %}`` … ``{% endgeneration %}`` around what an
  assistant turn produces, as Hugging Face defines it (``apply_chat_template(...,
  return_assistant_tokens_mask=True)``). The targets are the characters those blocks render,
  recorded while the text renders, exactly as transformers' ``AssistantTracker`` records them
  (transformers is no runtime dependency, so the extension is mirrored here; the tests check it
  against transformers' own mask).
- **Turn by turn**, for templates without such blocks. An assistant turn starts where the
  generation prompt after the messages before it ends (``add_generation_prompt``: what the model
  is given at inference). It ends where the conversation rendered up to and including it ends --
  when that rendering is a prefix of the text. Templates that render the last turn differently
  from earlier ones break that: Qwen3's keeps an assistant's reasoning (``<think>…</think>``)
  only after the last user message, so a turn rendered last carries its reasoning and the same
  turn followed by another user message does not. For such a turn the end is found in the text
  itself: the point up to which the text depends on the turn's content (the text rendered again
  with that content swapped for a character it does not hold), followed by the end-of-turn the
  template closes the turn with when it is the last (``<|im_end|>\\n``). A turn after another
  assistant turn that the generation prompt renders differently starts where that turn ends,
  past the generation prompt's header.

Policy for reasoning: a turn's targets are what the text holds of it. Qwen3's final turn (and
any after the last user message) keeps its ``<think>`` block, which is a target; an earlier
turn's reasoning is dropped by the template, so its answer and end-of-turn are the targets and
its reasoning is not trained on. Keeping it would need a text that is not the template's
rendering (the model would never see it at inference), or one sample per turn. A template that
keeps reasoning in every turn (a "training" variant, with or without generation blocks) trains
on all of it.

A turn that still cannot be found -- the template drops its content, or rewrites it into
something else once later messages follow -- makes the sample :class:`Corrupt`, with the
message and the reason.
"""

from __future__ import annotations

import json
import os
from contextvars import ContextVar
from typing import TYPE_CHECKING

from omniscale.errors import UserError
from omniscale.loaders.probe import Corrupt

if TYPE_CHECKING:
    from omniscale.loaders.chat import ChatFormat

Spans = tuple[tuple[int, int], ...]


def assistant_spans(chat: ChatFormat, messages: list[dict]) -> tuple[str, Spans]:
    """The conversation's text (``messages`` with string contents) and its target spans,
    [start, end) characters in order; :class:`Corrupt` when there are none or the template
    cannot be split into turns."""
    if has_generation_blocks(chat.template):
        text, marked = _render_marked(chat, messages)
        spans = tuple((s, e) for s, e in marked if e > s)
        if not spans:
            raise Corrupt(f"chat template ({chat.name}): its generation blocks mark nothing in "
                          "this conversation: nothing to train on")
        return text, spans
    text = render_text(chat, messages, False)
    spans, ends = [], {}
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _turn_start(chat, messages, i, text, ends.get(i - 1))
        ends[i] = end = _turn_end(chat, messages, i, text, start)
        if end > start:
            spans.append((start, end))
    if not spans:
        raise Corrupt("no assistant message: nothing to train on")
    return text, tuple(spans)


def _turn_start(chat, messages, i, text, previous_end: int | None) -> int:
    prompt = render_text(chat, messages[:i], True)
    if text.startswith(prompt):
        return len(prompt)
    # The prompt renders the assistant turn before it as the last one (Qwen3: with its empty
    # reasoning); past that turn's end in the text, the prompt's header must follow.
    before = render_text(chat, messages[:i], False)
    if previous_end is not None and prompt.startswith(before):
        header = prompt[len(before):]
        if text.startswith(header, previous_end):
            return previous_end + len(header)
    raise _cannot(i, "the messages before it render differently once it follows")


def _turn_end(chat, messages, i, text, start: int) -> int:
    alone = render_text(chat, messages[:i + 1], False)
    if len(alone) >= start and text.startswith(alone):
        return len(alone)
    mark = _absent_character(chat.template, messages)
    swapped = [*messages[:i], {**messages[i], "content": mark}, *messages[i + 1:]]
    swapped_text = render_text(chat, swapped, False)
    if swapped_text == text:
        raise _cannot(i, "none of its content is in the text")
    content_end = _changed_end(text, swapped_text)
    close = alone[_changed_end(alone, render_text(chat, swapped[:i + 1], False)):]
    if content_end < start or not text.startswith(close, content_end):
        raise _cannot(i, f"its content is not followed by the end of turn {close!r}")
    return content_end + len(close)


def _cannot(i: int, why: str) -> Corrupt:
    return Corrupt(f"message {i}: the template renders earlier turns differently once later "
                   f"ones follow, so the assistant's turn cannot be told apart ({why}; "
                   "train_on_prompt: true trains on the whole text)")


def _changed_end(text: str, other: str) -> int:
    """Where, in ``text``, the part that differs from ``other`` ends: ``text`` less the common
    suffix of the two after their common prefix."""
    head = len(os.path.commonprefix([text, other]))
    tail = len(os.path.commonprefix([text[head:][::-1], other[head:][::-1]]))
    return len(text) - tail


def _absent_character(template: str, messages: list[dict]) -> str:
    """A private-use character in neither the template nor any message, so that the text
    rendered with it as a turn's content differs from the text exactly where the content is."""
    used = set(template).union(*(m["content"] for m in messages))
    return next(c for c in map(chr, range(0xE000, 0xF900)) if c not in used)


def has_generation_blocks(template: str) -> bool:
    """Whether the template has a ``{% generation %}`` tag (a tag, not text in a comment or a
    string: read from Jinja's own token stream)."""
    found = _HAS_BLOCKS.get(template)
    if found is None:
        env = compiled(template).environment
        previous, found = None, False
        # the lexer's filtered stream: no whitespace, no comments
        for token in env.lexer.tokenize(env.preprocess(template)):
            if previous == "block_begin" and token.type == "name" and token.value == "generation":
                found = True
                break
            previous = token.type
        _HAS_BLOCKS[template] = found
    return found


_HAS_BLOCKS: dict[str, bool] = {}


def render_text(chat: ChatFormat, messages: list[dict], add_generation_prompt: bool) -> str:
    """The template rendered on ``messages``; :class:`Corrupt` when the template refuses."""
    import jinja2

    try:
        return compiled(chat.template).render(**_variables(chat, messages, add_generation_prompt))
    except jinja2.TemplateError as e:
        raise Corrupt(f"chat template ({chat.name}): {e}") from None


def _variables(chat, messages, add_generation_prompt) -> dict:
    return {"messages": messages, "add_generation_prompt": add_generation_prompt,
            "bos_token": chat.bos_token, "eos_token": chat.eos_token}


class _Tracker:
    """The characters rendered so far and the generation blocks' [start, end) spans."""

    def __init__(self):
        self.length = 0
        self.spans: list[tuple[int, int]] = []


_TRACKER: ContextVar[_Tracker | None] = ContextVar("chat_generation_tracker", default=None)


def _render_marked(chat, messages) -> tuple[str, list[tuple[int, int]]]:
    """The text, and the spans its generation blocks rendered (transformers'
    ``_render_with_assistant_indices``: a block starts at the length of what the template has
    yielded before it)."""
    import jinja2

    tracker = _Tracker()
    token = _TRACKER.set(tracker)
    pieces = []
    try:
        for piece in compiled(chat.template).generate(**_variables(chat, messages, False)):
            pieces.append(piece)
            tracker.length += len(piece)
    except jinja2.TemplateError as e:
        raise Corrupt(f"chat template ({chat.name}): {e}") from None
    finally:
        _TRACKER.reset(token)
    return "".join(pieces), tracker.spans


_COMPILED: dict[str, object] = {}


def compiled(template: str):
    """The template compiled once per process, in a sandbox (templates from model hubs are
    untrusted code), with what Hugging Face templates expect: blocks trimmed,
    ``raise_exception`` / ``tojson`` / ``strftime_now``, ``{% break %}`` / ``{% continue %}``
    and ``{% generation %}``."""
    found = _COMPILED.get(template)
    if found is not None:
        return found
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(Extension):
        """``{% generation %}…{% endgeneration %}`` renders its body unchanged and, while a
        conversation renders for its targets, records where the body went in the text."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body
                                          ).set_lineno(lineno)

        def _record(self, caller):
            text = caller()
            tracker = _TRACKER.get()
            if tracker is not None:
                tracker.spans.append((tracker.length, tracker.length + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, \
        sort_keys=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii,
                                    separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        result = env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"chat template: not valid Jinja (line {e.lineno}: {e.message})"
                        ) from None
    _COMPILED[template] = result
    return result
