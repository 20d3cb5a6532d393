"""OpenAI chat format: ``{"messages": [{"role": ..., "content": ...}, ...]}``.

``content`` is a string, ``null``, or a list of parts:

- ``{"type": "text", "text": ...}``;
- ``{"type": "image_url", "image_url": {"url": REF}}`` (or ``"image_url": REF``), and
  ``{"type": "image", "image": REF}`` (``url`` or ``path`` in place of ``image`` too, as
  Hugging Face chat templates write it); ``video`` / ``video_url`` and ``audio`` /
  ``audio_url`` likewise;
- ``{"type": "input_audio", "input_audio": {"data": BASE64, "format": "wav"}}``.

Roles: ``system`` (and ``developer``, OpenAI's newer name for it), ``user``, ``assistant``.
Tool calls and tool results are not conversations this form holds: such a record is skipped.
"""

from __future__ import annotations

from omniscale.loaders.importers.form import Conversation, conversation, expect_object, type_name
from omniscale.loaders.importers.media import MediaRef, inline
from omniscale.loaders.importers.records import MALFORMED, UNKNOWN_ROLE, Skip
from omniscale.media import MEDIA_KINDS

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def parse(record: object) -> Conversation:
    record = expect_object(record)
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Skip(MALFORMED, f"messages: expected a non-empty list, got {type_name(messages)}")
    out: list[dict] = []
    media: list[MediaRef] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise Skip(MALFORMED, f"{where}: expected an object, got {type_name(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise Skip(UNKNOWN_ROLE, f"{where}.role: unknown role {role!r} "
                                     f"(one of {', '.join(ROLES)})")
        if message.get("tool_calls") or message.get("function_call"):
            raise Skip(MALFORMED, f"{where}: tool calls are not supported")
        content = message.get("content")
        if isinstance(content, list):
            content = [_part(p, f"{where}.content[{j}]", media) for j, p in enumerate(content)]
        elif not isinstance(content, (str, type(None))):
            raise Skip(MALFORMED, f"{where}.content: expected a string or a list of parts, "
                                  f"got {type_name(content)}")
        out.append({"role": ROLES[role], "content": content})
    return conversation(out, media)


def _part(part: object, where: str, media: list[MediaRef]) -> dict:
    if not isinstance(part, dict):
        raise Skip(MALFORMED, f"{where}: expected an object, got {type_name(part)}")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise Skip(MALFORMED, f"{where}.text: expected a string, got "
                                  f"{type_name(part.get('text'))}")
        return {"type": "text", "text": part["text"]}
    if kind == "input_audio":
        value = part.get("input_audio")
        if not isinstance(value, dict):
            raise Skip(MALFORMED, f"{where}.input_audio: expected an object with data and "
                                  "format")
        media.append(inline("audio", value.get("data"), value.get("format"),
                            f"{where}.input_audio"))
        return {"type": "audio"}
    for media_kind in MEDIA_KINDS:
        if kind == media_kind:
            ref = next((part[k] for k in (media_kind, "url", "path") if part.get(k)), None)
        elif kind == f"{media_kind}_url":
            ref = part.get(kind)
            ref = ref.get("url") if isinstance(ref, dict) else ref
        else:
            continue
        if not isinstance(ref, str) or not ref:
            raise Skip(MALFORMED, f"{where}: expected a {media_kind} reference (a path or "
                                  f"URL), got {type_name(ref)}")
        media.append(MediaRef(media_kind, ref))
        return {"type": media_kind}
    raise Skip(MALFORMED, f"{where}.type: unknown part type {kind!r}")
