"""The conversation form's checks, one rule at a time (loaders/conversation.py): what
``normalize``, ``validate_messages`` and ``load_sample`` refuse, and the one line each says.
Every expected line is written out by hand from the form's rules (the module docstring)."""

from __future__ import annotations

import pytest

from omniscale.loaders.conversation import (
    ConversationError,
    load_sample,
    normalize,
    validate_messages,
)


def _turns(*user_parts) -> list[dict]:
    return [{"role": "user", "content": list(user_parts)},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]


def _refused(call, *args) -> str:
    with pytest.raises(ConversationError) as error:
        call(*args)
    return str(error.value)


@pytest.mark.parametrize("kind", ["tool", "json", "", "texts"])
def test_normalize_refuses_a_part_type_that_is_neither_text_nor_media(kind):
    # "tool" sorts after "text" and "json" before it: neither is text
    assert _refused(normalize, _turns({"type": kind, "text": "x"})) == (
        f"messages[0].content[0].type: unknown part type {kind!r} "
        "(one of text, image, video, audio)")


def test_a_conversation_whose_only_roles_sort_before_assistant_has_no_assistant_turn():
    # "user" and "system" are valid roles, none is the assistant's
    messages = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert _refused(validate_messages, messages) == "no assistant turn"
    messages[0]["role"] = "assistant"  # "assistant" sorts first: it is there now
    assert validate_messages(messages) == {"image": 0, "video": 0, "audio": 0}


def test_a_part_that_is_no_object_is_refused_naming_no_type():
    assert _refused(validate_messages, _turns("just text")) == (
        "messages[0].content[0]: expected a part of type text, image, video, audio, got None")


def test_a_part_of_an_unknown_type_is_refused_naming_that_type():
    assert _refused(validate_messages, _turns({"type": "tool"})) == (
        "messages[0].content[0]: expected a part of type text, image, video, audio, "
        "got 'tool'")


@pytest.mark.parametrize("part", [{"type": "image", "url": "a.jpg"},
                                  {"type": "audio", "path": "a.wav", "extra": 1}])
def test_a_media_part_with_a_reference_is_refused(part):
    assert _refused(validate_messages, _turns(part)) == (
        "messages[0].content[0]: a media part has no key but type (no reference)")


@pytest.mark.parametrize("part", [{"type": "text"}, {"text": "x", "type": "text", "lang": "en"},
                                  {"type": "text", "text": 3}])
def test_a_text_part_holds_exactly_its_type_and_a_string(part):
    got = {"type": "text"} if part == {"type": "text"} else part
    kind = "null" if "text" not in got else type(got["text"]).__name__
    assert _refused(validate_messages, _turns(part)) == (
        f"messages[0].content[0].text: expected a string, got {kind}")


def test_a_text_part_with_a_missing_key_replaced_is_refused():
    # the same number of keys as the form's, but not its keys
    assert _refused(validate_messages, _turns({"type": "text", "txt": "x"})) == (
        "messages[0].content[0].text: expected a string, got null")


@pytest.mark.parametrize("origin", [None, {"file": "train.jsonl", "line": 3}])
def test_origin_may_be_absent_or_an_object(origin):
    sample = {"messages": _turns({"type": "text", "text": "hi"})}
    if origin is not None:
        sample["origin"] = origin
    assert load_sample(sample) == sample


@pytest.mark.parametrize("origin, name", [("train.jsonl", "str"), (3, "int"), ([], "list")])
def test_origin_that_is_no_object_is_refused(origin, name):
    sample = {"messages": _turns({"type": "text", "text": "hi"}), "origin": origin}
    assert _refused(load_sample, sample) == f"origin: expected an object, got {name}"


def test_media_parts_without_members_name_both_counts():
    sample = {"messages": _turns({"type": "image"}, {"type": "image"})}
    assert _refused(load_sample, sample, {}) == "2 image part(s) but 0 image member(s)"
    assert _refused(load_sample, sample, {"image": 1}) == "2 image part(s) but 1 image member(s)"
    assert load_sample(sample, {"image": 2}) == sample
