"""Edges of ``loaders.chat`` on hand-checked cases: which template ``chat_template: tokenizer``
picks (as transformers loads it), the refusals of malformed templates, conversations and
members, and the token ranges of target spans against a brute-force oracle."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniscale.errors import UserError
from omniscale.loaders.chat import (
    CHATML,
    ChatFormat,
    chat_format,
    flatten,
    render,
    render_member,
    token_targets,
)
from omniscale.loaders.probe import Corrupt

HI = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
# CHATML on HI, written out by hand: the assistant's turn is what follows its header.
HI_TEXT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"


def _config(root, **config):
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root / "tokenizer.json"  # chat_format reads only the config beside it


def test_by_default_only_the_assistant_turn_is_a_target(tmp_path):
    rendered = render(HI, chat_format("chatml", tmp_path / "tokenizer.json"))
    assert rendered.text == HI_TEXT
    assert [rendered.text[s:e] for s, e in rendered.spans] == ["Yo<|im_end|>\n"]


def test_train_on_prompt_makes_the_whole_text_from_its_first_character_a_target(tmp_path):
    rendered = render(HI, chat_format("chatml", tmp_path / "tokenizer.json",
                                      train_on_prompt=True))
    assert rendered.text == HI_TEXT
    assert rendered.spans == ((0, len(HI_TEXT)),)


def test_named_templates_in_the_config_use_the_one_named_default(tmp_path):
    # transformers saves several templates as a list of {name, template}; the default one
    # renders (names before and after "default" in sort order, and a stray entry, around it)
    tokenizer = _config(tmp_path, chat_template=[
        "stray", {"name": "alpha", "template": "A"}, {"name": "tool_use", "template": "T"},
        {"name": "default", "template": CHATML}, {"name": "rag", "template": "R"}])
    assert chat_format("tokenizer", tokenizer).template == CHATML


def test_a_chat_template_jinja_beside_the_config_wins_as_in_transformers(tmp_path):
    """transformers' from_pretrained loads chat_template.jinja over the config's template (so
    apply_chat_template renders with it); the text must be the same one."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json"))
    old = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = _config(tmp_path, chat_template=old, tokenizer_class="PreTrainedTokenizerFast")
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.chat_template == CHATML  # the oracle: what transformers loads
    chat = chat_format("tokenizer", tokenizer)
    assert chat.template == CHATML
    assert render(HI, chat).text == hf.apply_chat_template(HI, tokenize=False) == HI_TEXT


def test_the_config_template_is_used_when_no_jinja_file_is_beside_it(tmp_path):
    tokenizer = _config(tmp_path, chat_template=CHATML, bos_token="<s>",
                        eos_token={"content": "</s>"})
    assert chat_format("tokenizer", tokenizer) == ChatFormat(CHATML, "tokenizer", False,
                                                             "<s>", "</s>")


@pytest.mark.parametrize("template", ["", 42, ["x"], [{"name": "tool_use", "template": "T"}]])
def test_an_empty_or_non_text_template_in_the_config_is_refused(tmp_path, template):
    with pytest.raises(UserError, match="tokenizer_config.json: no chat_template"):
        chat_format("tokenizer", _config(tmp_path, chat_template=template))


def test_an_unreadable_jinja_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"missing\.jinja: .*\(FileNotFoundError\)"):
        chat_format(str(tmp_path / "missing.jinja"), tmp_path / "tokenizer.json")
    (tmp_path / "latin1.jinja").write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.jinja: .*\(UnicodeDecodeError\)"):
        chat_format(str(tmp_path / "latin1.jinja"), tmp_path / "tokenizer.json")


def test_a_jinja_file_is_read_as_the_template(tmp_path):
    (tmp_path / "mine.jinja").write_text(CHATML)
    assert chat_format(str(tmp_path / "mine.jinja"), tmp_path / "tokenizer.json",
                       train_on_prompt=True) == ChatFormat(CHATML, str(tmp_path / "mine.jinja"),
                                                           True)


@pytest.mark.parametrize("messages", [[], {}, "", None])
def test_no_messages_is_corrupt(messages):
    with pytest.raises(Corrupt, match="'messages' is not a non-empty list"):
        flatten(messages)


def test_a_media_part_becomes_its_marker_even_when_it_carries_text():
    flat, media = flatten([{"role": "user", "content": [
        {"type": "audio", "text": "a transcript"}, {"type": "image", "text": "a caption"},
        {"type": "text", "text": "and?"}]}])
    assert flat == [{"role": "user", "content": "<audio><image>and?"}]
    assert media == {"image": 1, "video": 0, "audio": 1}


@pytest.mark.parametrize("part", [{"type": "caption", "text": "x"}, {"type": "text", "text": 5},
                                  {"type": "text"}, "just a string"])
def test_a_part_that_is_no_text_or_media_part_is_corrupt(part):
    with pytest.raises(Corrupt, match="message 0 part 1: not a text, image, video or audio"):
        flatten([{"role": "user", "content": [{"type": "text", "text": "ok"}, part]}])


@pytest.mark.parametrize("data, reason", [
    (b"{not json", "not JSON"),
    (b'{"text": "hi"}', "not an object with 'messages'"),
    (b'"messages"', "not an object with 'messages'"),
    (b'[{"messages": []}]', "not an object with 'messages'")])
def test_a_member_that_is_no_conversation_object_is_corrupt(data, reason):
    with pytest.raises(Corrupt, match=reason):
        render_member(data, ChatFormat(CHATML))


def test_a_conversation_member_renders_its_messages():
    rendered = render_member(json.dumps({"messages": HI}).encode(), ChatFormat(CHATML))
    assert rendered.text == HI_TEXT


def test_chat_format_and_rendered_are_immutable_values():
    """A source's format is shared by every sample it renders (and keys caches by value)."""
    chat = ChatFormat(CHATML)
    assert hash(chat) == hash(ChatFormat(CHATML)) and {chat: 1}[ChatFormat(CHATML)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        chat.train_on_prompt = True
    rendered = render(HI, chat)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rendered.spans = ((0, 1),)


def test_tokens_after_a_gap_between_spans_are_found():
    # spans [0,1) and [5,9); tokens start at 0, 3, 6, 7: token 0 is in the first span, token 1
    # (start 3) in none, tokens 2 and 3 in the second -- one range [2, 4)
    offsets = [(0, 3), (3, 6), (6, 7), (7, 9)]
    assert token_targets(offsets, [(5, 9), (0, 1)]) == [(0, 1), (2, 4)]


def _brute_force(offsets, spans):
    """Token t is a target when any span holds its first character; runs of them as ranges."""
    ranges = []
    for t, (start, _) in enumerate(offsets):
        if any(s <= start < e for s, e in spans):
            if ranges and ranges[-1][1] == t:
                ranges[-1][1] = t + 1
            else:
                ranges.append([t, t + 1])
    return [tuple(r) for r in ranges]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), max_size=12), st.data())
def test_token_ranges_equal_a_brute_force_scan(lengths, data):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    offsets = [(s, s + n) for s, n in zip(starts, lengths)]
    size = sum(lengths) + 2
    cuts = sorted(data.draw(st.sets(st.integers(0, size), max_size=8)))
    spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2])]  # disjoint, in any order
    spans = data.draw(st.permutations(spans))
    assert token_targets(offsets, spans) == _brute_force(offsets, spans)
