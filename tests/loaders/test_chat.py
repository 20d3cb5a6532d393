"""Conversation sources (``loaders.chat``): the rendered text equals transformers'
``apply_chat_template``; the targets are exactly the assistant's tokens, checked against
transformers' own assistant mask (``{% generation %}`` in the template) -- through the index
and the decoder, with media in the turns; ``train_on_prompt``; one-line refusals."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from omniscale.dataplane.spec import SpecError, load_spec
from omniscale.errors import UserError
from omniscale.index_schema import read_index
from omniscale.layout import IGNORE_INDEX, SPECIAL_TOKENS
from omniscale.loaders.chat import CHATML, ChatFormat, chat_format, flatten, render
from omniscale.loaders.decode import SampleDecoder
from omniscale.loaders.index import index_paths
from omniscale.loaders.readers import SampleReader
from omniscale.loaders.token_ids import TokenIds
from tests.loaders.decode_fixtures import ref_of
from tests.loaders.index_fixtures import write_jsonl, write_tar

transformers = pytest.importorskip("transformers")

CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
# ChatML with transformers' generation markers around what an assistant turn adds: the
# oracle of which tokens are the assistant's
CHATML_MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A tokenizer's own template in the style of the Hub's: a default system turn, bos/eos.
HUB_STYLE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' "
    "+ message['content'] | trim + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Rewrites earlier turns once later ones follow (as reasoning templates drop old thoughts).
REWRITING = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ 'A: (earlier)\n' }}{% else %}{{ message['role'][0] | upper + ': ' "
    "+ message['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape?"}]},
     {"role": "assistant", "content": "A red square."},
     {"role": "user", "content": [{"type": "text", "text": "And this one? "}, {"type": "image"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "A circle, blue."}]}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": [{"type": "text", "text": "Colour of "}, {"type": "image"},
                                  {"type": "text", "text": "?"}]},
     {"role": "assistant", "content": ""},  # an empty assistant turn: its end is still learnt
     {"role": "user", "content": "Again?"},
     {"role": "assistant", "content": "Red."}],
]
CORPUS = ["What shape? A red square. And this one? A circle, blue.",
          "Answer in one word. Colour of ? Red. Again? You are helpful. user assistant system"]


def _tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(
        vocab_size=330, special_tokens=SPECIAL_TOKENS + CHAT_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-tokenizer")
    return _tokenizer(root / "tokenizer.json")


def _hf(tokenizer_path, template):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path),
                                                chat_template=template, bos_token="<pad>",
                                                eos_token="<eos>")


@pytest.mark.parametrize("template", [CHATML, HUB_STYLE])
def test_text_equals_transformers_apply_chat_template(tokenizer, tmp_path, template):
    (tmp_path / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<pad>",
         "eos_token": {"content": "<eos>", "special": True}}))
    chat = chat_format("tokenizer", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<pad>",
                                                                "eos_token": "<eos>"}))
    (tmp_path / "chat_template.jinja").write_text(template)  # as transformers 4.43+ saves it
    assert chat_format("tokenizer", tmp_path / "tokenizer.json") == chat
    hf = _hf(tokenizer, template)
    for messages in CONVERSATIONS:
        flat, media = flatten(messages)
        assert render(messages, chat).text == hf.apply_chat_template(flat, tokenize=False)
        assert media["image"] == sum(p.get("type") == "image" for m in messages
                                     for p in (m["content"] if isinstance(m["content"], list)
                                               else []))


def _spec(root, tokenizer, source: dict, fmt="webdataset") -> object:
    (root / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    spec = {"tokenizer": "tokenizer.json", "media": {"patch_size": 8},
            "sources": [{"name": "chat", "path": "chat", "format": fmt, "weight": 1,
                         "template": "conversation", **source}]}
    (root / "mix.yaml").write_text(yaml.safe_dump(spec))
    return root / "mix.yaml"


def _png(size: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, 24), (200, size, 10)).save(buf, "PNG")
    return buf.getvalue()


def _conversation_shard(root, conversations):
    members = []
    for i, messages in enumerate(conversations):
        members.append((f"s{i}.json", json.dumps({"messages": messages}).encode()))
        images = sum(p.get("type") == "image" for m in messages
                     for p in (m["content"] if isinstance(m["content"], list) else []))
        members += [(f"s{i}.{j}.png", _png(32 + 8 * j)) for j in range(images)]
    write_tar(root / "chat" / "shard-0.tar", members)


def _decoders(spec):
    sources = {s.name: s.path for s in spec.sources}
    with_ids = SampleDecoder(SampleReader(sources), spec.tokenizer, spec.media,
                             TokenIds(sources), spec.special_tokens)
    rendering = SampleDecoder(SampleReader(sources), spec.tokenizer, spec.media,
                              special=spec.special_tokens)  # no ids: renders the messages
    return with_ids, rendering


def test_targets_are_exactly_the_assistant_tokens_through_index_and_decoder(tokenizer,
                                                                             tmp_path):
    _conversation_shard(tmp_path, CONVERSATIONS)
    spec_path = _spec(tmp_path, tokenizer, {"chat_template": "chatml"})
    index_paths([spec_path], workers=1, progress=False)
    spec = load_spec(spec_path)
    rows = read_index(spec.sources[0].path).to_pylist()
    assert [r["error"] for r in rows] == [None, None]
    hf = _hf(tokenizer, CHATML_MARKED)
    eos = hf.convert_tokens_to_ids("<eos>")
    image = hf.convert_tokens_to_ids("<image>")
    for row, messages, decoders in zip(rows, CONVERSATIONS, [_decoders(spec)] * 2):
        oracle = hf.apply_chat_template(flatten(messages)[0], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
        ids, mask = oracle["input_ids"], oracle["assistant_masks"]
        assert row["text_ids"] == ids  # the index's ids are the template's text, tokenized
        # every assistant token is a target once, nothing else is; the end of the sample
        # follows the conversation's last token (an assistant's)
        want = [t for t, m in zip(ids, mask) if m] + [eos]
        assert row["target_tokens"] == len(want)
        samples = [d.decode(ref_of("chat", row)) for d in decoders]
        for sample in samples:
            labels = sample.labels_L.tolist()
            assert [t for t in labels if t != IGNORE_INDEX] == want
            assert sample.input_ids_L.tolist().count(image) == sum(
                it.num_tokens for it in sample.media)  # the images' blocks, where marked
            assert len(sample.media) == sum(t == image for t in ids)
        assert samples[0].input_ids_L.tolist() == samples[1].input_ids_L.tolist()
        assert samples[0].labels_L.tolist() == samples[1].labels_L.tolist()


def test_train_on_prompt_makes_every_text_token_a_target_in_jsonl(tokenizer, tmp_path):
    text_only = [[{"role": "user", "content": "Again?"},
                  {"role": "assistant", "content": "Red."}]]
    write_jsonl(tmp_path / "chat" / "part-0.jsonl", [{"messages": m} for m in text_only])
    spec_path = _spec(tmp_path, tokenizer, {"train_on_prompt": True}, fmt="jsonl")
    index_paths([spec_path], workers=1, progress=False)
    spec = load_spec(spec_path)
    row = read_index(spec.sources[0].path).to_pylist()[0]
    assert row["error"] is None
    hf = _hf(tokenizer, CHATML)
    ids = hf.apply_chat_template(text_only[0], tokenize=True, return_dict=True)["input_ids"]
    eos = hf.convert_tokens_to_ids("<eos>")
    assert row["target_tokens"] == len(ids)  # all but the first, plus <eos>
    for decoder in _decoders(spec):
        labels = decoder.decode(ref_of("chat", row)).labels_L.tolist()
        assert [t for t in labels if t != IGNORE_INDEX] == ids[1:] + [eos]


def test_bad_conversations_are_marked_with_their_reason(tokenizer, tmp_path):
    bad = [[{"role": "user", "content": "no answer"}],
           [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}],
           CONVERSATIONS[1]]
    _conversation_shard(tmp_path, bad)
    (tmp_path / "rewriting.jinja").write_text(REWRITING)
    spec_path = _spec(tmp_path, tokenizer, {"chat_template": "rewriting.jinja"})
    index_paths([spec_path], workers=1, progress=False)
    errors = [r["error"] for r in read_index(load_spec(spec_path).sources[0].path).to_pylist()]
    assert "no assistant message: nothing to train on" in errors[0]
    assert "message 1: not an object with a role of system, user, assistant" in errors[1]
    assert "message 2: the template renders earlier turns differently" in errors[2]


def test_spec_mistakes_are_one_line(tokenizer, tmp_path):
    spec_path = _spec(tmp_path, tokenizer, {"chat_template": "tokenizer"})
    (tmp_path / "chat").mkdir()
    with pytest.raises(UserError, match=r"mix\.yaml: sources\[0\]\.chat_template: .*"
                                        r"tokenizer_config\.json: chat_template: tokenizer "
                                        r"needs a readable"):
        index_paths([spec_path], workers=1, progress=False)
    raw = yaml.safe_load(spec_path.read_text())
    raw["sources"][0]["chat_template"] = "nowhere.jinja"
    spec_path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"sources\[0\]\.chat_template: 'nowhere\.jinja' is "
                                        r"not chatml, tokenizer or an existing Jinja file"):
        load_spec(spec_path)
    raw["sources"][0].update(template="text", chat_template="chatml")
    spec_path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"sources\[0\]\.chat_template: only for template: "
                                        r"conversation \(this source is text\)"):
        load_spec(spec_path)
    raw["sources"][0].update(template="conversation", format="parquet")
    spec_path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"sources\[0\]\.format: a conversation source is "
                                        r"webdataset"):
        load_spec(spec_path)


def test_a_target_span_maps_to_the_tokens_starting_inside_it():
    from omniscale.loaders.chat import targets_mask, token_targets

    offsets = [(0, 2), (2, 5), (5, 6), (6, 9), (9, 12)]
    assert token_targets(offsets, [(2, 6), (9, 12)]) == [(1, 3), (4, 5)]
    assert targets_mask([1, 3, 4, 5], 5).tolist() == [False, True, True, False, True]
    assert ChatFormat.from_dict(ChatFormat(CHATML).to_dict()) == ChatFormat(CHATML)
    assert np.array_equal(targets_mask([], 3), np.zeros(3, bool))


def test_a_long_conversation_split_over_sp_ranks_keeps_its_mask(tokenizer, tmp_path):
    from omniscale.loaders.collate import collate

    turns = []
    for i in range(12):  # longer than a slice: its turns end up on different SP ranks
        turns += [{"role": "user", "content": [{"type": "text", "text": f"What shape? {i}"}]
                   + ([{"type": "image"}] if i == 5 else [])},
                  {"role": "assistant", "content": f"A red square, blue circle {i}."}]
    _conversation_shard(tmp_path, [turns])
    spec_path = _spec(tmp_path, tokenizer, {})
    index_paths([spec_path], workers=1, progress=False)
    spec = load_spec(spec_path)
    row = read_index(spec.sources[0].path).to_pylist()[0]
    sample = _decoders(spec)[0].decode(ref_of("chat", row))
    hf = _hf(tokenizer, CHATML_MARKED)
    oracle = hf.apply_chat_template(flatten(turns)[0], tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
    want = [t for t, m in zip(oracle["input_ids"], oracle["assistant_masks"]) if m]
    want.append(hf.convert_tokens_to_ids("<eos>"))
    k = 3
    slices = [collate([(sample, k, i)], spec.media) for i in range(k)]
    labels = torch.cat([b.labels_T for b in slices])[:len(sample)]
    assert torch.equal(labels, torch.from_numpy(sample.labels_L))
    assert [t for t in labels.tolist() if t != IGNORE_INDEX] == want
    assert all((b.labels_T != IGNORE_INDEX).any() for b in slices)  # targets on every rank


def test_target_tokens_of_other_sources_count_the_decoded_labels(demo_root):
    """Every source's index counts its targets as the decoder's labels have them (plain text
    takes a shortcut; media and markers go through the sequence layout)."""
    spec = load_spec(demo_root / "mix.yaml")
    decoder = SampleDecoder(SampleReader({s.name: s.path for s in spec.sources}), spec.tokenizer,
                            spec.media, special=spec.special_tokens)
    for source in spec.sources:
        for row in read_index(source.path).to_pylist()[:3]:
            labels = decoder.decode(ref_of(source.name, row)).labels_L
            assert row["target_tokens"] == int((labels != IGNORE_INDEX).sum()), source.name
