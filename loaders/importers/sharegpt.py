"""ShareGPT format: ``{"conversations": [{"from": ..., "value": ...}, ...], "images": [...]}``.

``from`` is ``human`` (or ``user``), ``gpt`` (or ``assistant``) or ``system``; a top-level
``system`` string becomes a first system turn. Media lists: ``image`` / ``images``, ``video`` /
``videos``, ``audio`` / ``audios``, each a reference or a list of them (``loaders.importers
.media``). In a ``value``, ``<image>`` / ``<video>`` / ``<audio>`` marks where each item of that
kind goes, in list order; a kind with no marker anywhere has its items at the start of the
first human turn. A kind with markers must have exactly as many items as markers.
"""

from __future__ import annotations

import re

from omniscale.layout import DEFAULT_SPECIAL_TOKENS, count_markers
from omniscale.loaders.importers.form import Conversation, conversation, expect_object, type_name
from omniscale.loaders.importers.media import MediaRef
from omniscale.loaders.importers.records import MALFORMED, MARKERS, UNKNOWN_ROLE, Skip
from omniscale.media import MEDIA_KINDS

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system"}
FIELDS = {"image": ("image", "images"), "video": ("video", "videos"),
          "audio": ("audio", "audios")}
MARKER = DEFAULT_SPECIAL_TOKENS.markers  # kind -> "<image>" ...
_KIND_OF = {marker: kind for kind, marker in MARKER.items()}
_SPLIT = re.compile("(" + "|".join(map(re.escape, MARKER.values())) + ")")


def parse(record: object) -> Conversation:
    return parse_turns(record, FIELDS)


def parse_turns(record: object, fields: dict[str, tuple[str, ...]]) -> Conversation:
    """A record with ``conversations`` and the media fields ``fields`` names per kind."""
    record = expect_object(record)
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise Skip(MALFORMED, f"conversations: expected a non-empty list, got "
                              f"{type_name(turns)}")
    messages = []
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise Skip(MALFORMED, f"system: expected a string, got {type_name(system)}")
    if system:
        messages.append(("system", system))
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise Skip(MALFORMED, f"{where}: expected an object, got {type_name(turn)}")
        if turn.get("from") not in ROLES:
            raise Skip(UNKNOWN_ROLE, f"{where}.from: unknown role {turn.get('from')!r} "
                                     f"(one of {', '.join(ROLES)})")
        value = turn.get("value")
        if not isinstance(value, (str, type(None))):
            raise Skip(MALFORMED, f"{where}.value: expected a string, got {type_name(value)}")
        messages.append((ROLES[turn["from"]], value or ""))
    return _place(messages, {kind: _items(record, kind, fields.get(kind, ()))
                             for kind in MEDIA_KINDS})


def _items(record: dict, kind: str, names: tuple[str, ...]) -> list[MediaRef]:
    present = [n for n in names if record.get(n) is not None]
    if len(present) > 1:
        raise Skip(MALFORMED, f"both {' and '.join(present)}: give one")
    if not present:
        return []
    value = record[present[0]]
    refs = [value] if isinstance(value, str) else value
    if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
        raise Skip(MALFORMED, f"{present[0]}: expected a path or URL, or a list of them")
    return [MediaRef(kind, r) for r in refs]


def _place(turns: list[tuple[str, str]], items: dict[str, list[MediaRef]]) -> Conversation:
    """Messages with each item where its marker is, unmarked kinds in the first human turn."""
    counts = dict.fromkeys(MEDIA_KINDS, 0)
    for _, text in turns:
        for kind, n in count_markers(text).items():
            counts[kind] += n
    for kind in MEDIA_KINDS:
        if counts[kind] and counts[kind] != len(items[kind]):
            raise Skip(MARKERS, f"{counts[kind]} {MARKER[kind]} marker(s) but "
                                f"{len(items[kind])} {kind} item(s)")
    unmarked = [{"type": kind} for kind in MEDIA_KINDS
                if not counts[kind] for _ in items[kind]]
    first_user = next((i for i, (role, _) in enumerate(turns) if role == "user"), None)
    if unmarked and first_user is None:
        raise Skip(MALFORMED, "media items without markers, and no human turn to put them in")
    messages = []
    for i, (role, text) in enumerate(turns):
        parts = [{"type": _KIND_OF[piece]} if piece in _KIND_OF else {"type": "text",
                                                                         "text": piece}
                 for piece in _SPLIT.split(text) if piece]
        messages.append({"role": role,
                         "content": (unmarked if i == first_user else []) + parts})
    pending = {kind: iter(items[kind]) for kind in MEDIA_KINDS}
    media = [next(pending[part["type"]]) for message in messages
             for part in message["content"] if part["type"] != "text"]
    return conversation(messages, media)
