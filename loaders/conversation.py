"""The conversation form: what a conversation sample's ``KEY.json`` holds.

``omniscale data import`` writes every conversation in this one form, whatever format it came
in, and the chat-template renderer reads exactly this form. A conversation sample is
``KEY.json`` plus its media members::

    {"messages": [MESSAGE, ...], "origin": {"file": "train.jsonl", "line": 12}}

- ``messages``: a non-empty list of ``{"role": ROLE, "content": [PART, ...]}`` (those two keys
  only). At least one message has the role ``assistant``.
- ``ROLE``: ``"system"``, ``"user"`` or ``"assistant"``.
- ``content``: always a non-empty list of parts, each exactly one of

  - ``{"type": "text", "text": STR}`` -- the text as the source had it (newlines around a media
    marker included); a turn with no text, an empty assistant turn say, is one empty text part;
  - ``{"type": "image"}``, ``{"type": "video"}``, ``{"type": "audio"}`` -- a media item, with
    no reference: the k-th ``image`` part of the conversation (counting from 0 through every
    message in order) is the member ``KEY.k.EXT`` with an image extension
    (``omniscale.layout.IMAGE_EXTS``); videos and audio likewise, numbered per kind:
    ``KEY.0.jpg``, ``KEY.1.png``, ``KEY.0.mp4``, ``KEY.0.wav``. The members hold the source's
    original bytes under its original extension.

- ``origin``: where the conversation came from, never rendered: ``file`` (the input file,
  relative to the import's input root) and ``line`` (the line its record starts on); ``index``
  (the record's position in a JSON array file, where one line may hold several) and ``id``
  (the record's own id) when there are such.

:func:`normalize` turns the lenient spellings importers meet (content as a string, ``None``,
media parts carrying a reference) into the form; :func:`validate_messages` and
:func:`load_sample` check it, the latter a whole ``KEY.json`` against the sample's members.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from omniscale.media import MEDIA_KINDS

ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", *MEDIA_KINDS)


class ConversationError(ValueError):
    """A conversation that is not in the form; the message is one line saying what is wrong."""


def normalize(messages: object) -> list[dict]:
    """``messages`` in the form, checked: a string (or ``None``) content becomes one text part,
    media parts lose any key but ``type`` (their reference), and empty text parts beside other
    parts are dropped. Raises :class:`ConversationError`."""
    if not isinstance(messages, list):
        raise ConversationError(f"messages: expected a list, got {_type(messages)}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConversationError(f"messages[{i}]: expected an object, got {_type(message)}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            parts = [{"type": "text", "text": content or ""}]
        elif isinstance(content, list):
            parts = [_part(p, f"messages[{i}].content[{j}]") for j, p in enumerate(content)]
            parts = [p for p in parts if p != {"type": "text", "text": ""}] or \
                [{"type": "text", "text": ""}]
        else:
            raise ConversationError(f"messages[{i}].content: expected a string or a list, "
                                    f"got {_type(content)}")
        out.append({"role": message.get("role"), "content": parts})
    validate_messages(out)
    return out


def _part(part: object, where: str) -> dict:
    if not isinstance(part, dict):
        raise ConversationError(f"{where}: expected an object, got {_type(part)}")
    kind = part.get("type")
    if kind in MEDIA_KINDS:
        return {"type": kind}
    if kind == "text":
        return {"type": "text", "text": part.get("text")}
    raise ConversationError(f"{where}.type: unknown part type {kind!r} "
                            f"(one of {', '.join(PART_TYPES)})")


def validate_messages(messages: object) -> dict[str, int]:
    """Check that ``messages`` is exactly in the form; return its media parts per kind.

    Raises :class:`ConversationError` naming the first thing wrong, e.g.
    ``messages[2].role: unknown role 'tool' (one of system, user, assistant)``.
    """
    if not isinstance(messages, list) or not messages:
        raise ConversationError("messages: expected a non-empty list")
    counts = dict.fromkeys(MEDIA_KINDS, 0)
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ConversationError(f"{where}: expected an object with keys role and content")
        if message["role"] not in ROLES:
            raise ConversationError(f"{where}.role: unknown role {message['role']!r} "
                                    f"(one of {', '.join(ROLES)})")
        content = message["content"]
        if not isinstance(content, list) or not content:
            raise ConversationError(f"{where}.content: expected a non-empty list of parts")
        for j, part in enumerate(content):
            _check_part(part, f"{where}.content[{j}]")
            if part["type"] != "text":
                counts[part["type"]] += 1
    if not any(m["role"] == "assistant" for m in messages):
        raise ConversationError("no assistant turn")
    return counts


def _check_part(part: object, where: str) -> None:
    if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
        kind = part.get("type") if isinstance(part, dict) else None
        raise ConversationError(f"{where}: expected a part of type {', '.join(PART_TYPES)}, "
                                f"got {kind!r}")
    if part["type"] != "text":
        if len(part) != 1:
            raise ConversationError(f"{where}: a media part has no key but type (no "
                                    "reference)")
        return
    text = part.get("text")
    if set(part) != {"type", "text"} or not isinstance(text, str):
        raise ConversationError(f"{where}.text: expected a string, got {_type(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConversationError(f"{where}.text: not valid Unicode (a lone surrogate)") from None


def media_counts(messages: list[dict]) -> dict[str, int]:
    """Media parts per kind of a conversation in the form."""
    counts = dict.fromkeys(MEDIA_KINDS, 0)
    for message in messages:
        for part in message["content"]:
            if part["type"] in counts:
                counts[part["type"]] += 1
    return counts


def load_sample(data: bytes | str | Mapping, media: Mapping[str, int] | None = None) -> dict:
    """A conversation sample's ``KEY.json`` (bytes, text or parsed), checked; with ``media``
    (the sample's members per kind, e.g. ``{"image": 2}``) also that every media part has its
    member and every member its part. Raises :class:`ConversationError`."""
    if not isinstance(data, Mapping):
        try:
            data = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ConversationError(f"not JSON ({e})") from None
    if not isinstance(data, Mapping):
        raise ConversationError(f"expected an object, got {_type(data)}")
    counts = validate_messages(data.get("messages"))
    origin = data.get("origin")
    if origin is not None and not isinstance(origin, Mapping):
        raise ConversationError(f"origin: expected an object, got {_type(origin)}")
    if media is not None:
        for kind in MEDIA_KINDS:
            if counts[kind] != media.get(kind, 0):
                raise ConversationError(f"{counts[kind]} {kind} part(s) but "
                                        f"{media.get(kind, 0)} {kind} member(s)")
    return dict(data)


def _type(value: object) -> str:
    return "null" if value is None else type(value).__name__
