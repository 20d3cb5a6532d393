"""The conversation form (``loaders.conversation``): what it accepts, and one line for what
it does not."""

from __future__ import annotations

import json

import pytest

from omniscale.loaders.conversation import (
    ConversationError,
    load_sample,
    media_counts,
    normalize,
    validate_messages,
)

GOOD = [
    {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                 {"type": "image"}, {"type": "audio"}]},
    {"role": "assistant", "content": [{"type": "text", "text": ""}]},
    {"role": "user", "content": [{"type": "video"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "a clip"}]},
]


def test_the_form_is_accepted_and_counted():
    assert validate_messages(GOOD) == {"image": 2, "video": 1, "audio": 1}
    assert media_counts(GOOD) == {"image": 2, "video": 1, "audio": 1}
    assert normalize(GOOD) == GOOD


@pytest.mark.parametrize("messages, message", [
    ([], "messages: expected a non-empty list"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "x"}]}],
     "messages[0].content: expected a non-empty list of parts"),
    ([{"role": "tool", "content": [{"type": "text", "text": "x"}]}],
     "messages[0].role: unknown role 'tool' (one of system, user, assistant)"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "no assistant turn"),
    ([{"role": "assistant", "content": [{"type": "image", "image": "a.jpg"}]}],
     "messages[0].content[0]: a media part has no key but type (no reference)"),
    ([{"role": "assistant", "content": [{"type": "text", "text": 3}]}],
     "messages[0].content[0].text: expected a string, got int"),
    ([{"role": "assistant", "content": [{"type": "text", "text": "\ud800"}]}],
     "messages[0].content[0].text: not valid Unicode (a lone surrogate)"),
    ([{"role": "assistant", "name": "x", "content": [{"type": "text", "text": "x"}]}],
     "messages[0]: expected an object with keys role and content"),
])
def test_what_is_not_the_form_is_named(messages, message):
    with pytest.raises(ConversationError) as e:
        validate_messages(messages)
    assert str(e.value) == message


def test_normalize_takes_lenient_spellings():
    lenient = [{"role": "user", "content": [{"type": "text", "text": ""},
                                            {"type": "image", "url": "x.png"}]},
               {"role": "assistant", "content": None}]
    assert normalize(lenient) == [
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]}]
    assert normalize([{"role": "assistant", "content": "hi"}]) == [
        {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]


def test_load_sample_checks_the_members():
    data = json.dumps({"messages": GOOD, "origin": {"file": "a.jsonl", "line": 1}}).encode()
    assert load_sample(data, {"image": 2, "video": 1, "audio": 1})["messages"] == GOOD
    with pytest.raises(ConversationError, match=r"^2 image part\(s\) but 1 image member"):
        load_sample(data, {"image": 1, "video": 1, "audio": 1})
    with pytest.raises(ConversationError, match="^not JSON"):
        load_sample(b"{")
