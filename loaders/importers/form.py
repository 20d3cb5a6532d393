"""What a format's importer makes of a record: a conversation in the form, with its media."""

from __future__ import annotations

from dataclasses import dataclass

from omniscale.loaders.conversation import ConversationError, normalize
from omniscale.loaders.importers.media import MediaRef
from omniscale.loaders.importers.records import MALFORMED, NO_ASSISTANT, Skip


@dataclass
class Conversation:
    """``messages`` in the form (``loaders.conversation``); ``media`` its items in the order
    their parts appear."""

    messages: list[dict]
    media: list[MediaRef]


def conversation(messages: list[dict], media: list[MediaRef]) -> Conversation:
    """Messages whose roles are already mapped to the form's, and whose media parts come in
    the order of ``media``, normalized and checked; raises :class:`Skip`."""
    if not any(m.get("role") == "assistant" for m in messages):
        raise Skip(NO_ASSISTANT, "no assistant turn")
    try:
        return Conversation(normalize(messages), media)
    except ConversationError as e:
        raise Skip(MALFORMED, str(e)) from None


def expect_object(record: object) -> dict:
    if not isinstance(record, dict):
        raise Skip(MALFORMED, f"expected an object, got {type_name(record)}")
    return record


def type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__
