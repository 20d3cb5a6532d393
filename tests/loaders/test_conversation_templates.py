"""Real chat templates (``tests/loaders/chat_templates/``, each naming where it came from) on
multi-turn conversations with and without reasoning: the text is transformers'
``apply_chat_template``; with ``{% generation %}`` blocks the targets are transformers' own
assistant mask; without, Llama 3's split equals the mask of TRL's generation-marked Llama 3, and
Qwen3's split -- whose template keeps reasoning only after the last user message -- equals the
split checked by hand below, through the index and the decoder too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from omniscale.dataplane.spec import load_spec
from omniscale.index_schema import read_index
from omniscale.layout import IGNORE_INDEX, SPECIAL_TOKENS
from omniscale.loaders.chat import ChatFormat, flatten, render, targets_mask, token_targets
from omniscale.loaders.chat_turns import has_generation_blocks
from omniscale.loaders.decode import SampleDecoder
from omniscale.loaders.index import index_paths
from omniscale.loaders.probe import Corrupt
from omniscale.loaders.readers import SampleReader
from omniscale.loaders.token_ids import TokenIds
from tests.loaders.decode_fixtures import ref_of
from tests.loaders.index_fixtures import write_tar

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parent / "chat_templates"
BOS = "<|begin_of_text|>"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", BOS,
               "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN3 = ["qwen3", "qwen3_0.6b_first_release"]  # two published revisions
PLAIN = [*QWEN3, "llama3", "llama3.3", "chatml_vllm"]  # no generation blocks
MARKED = ["qwen3_training", "llama3_training", "qwen2.5_training"]


def _template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def _think(reasoning: str, answer: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}"


REASONING = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": _think("Add them.", "4")},
    {"role": "user", "content": [{"type": "text", "text": "And this shape? "}, {"type": "image"}]},
    {"role": "assistant",
     "content": [{"type": "text", "text": _think("Four sides.", "A square.")}]},
]
PLAIN_TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Times 3?"},
    {"role": "assistant", "content": "12"},
    {"role": "user", "content": "Minus 2?"},
    {"role": "assistant", "content": "10"},
]
# two assistant turns after the last user message, the first without reasoning
TWO_ANSWERS = [
    {"role": "user", "content": "Say hi, then think."},
    {"role": "assistant", "content": "Hi."},
    {"role": "assistant", "content": _think("Done.", "Bye.")},
]
CONVERSATIONS = {"reasoning": REASONING, "plain": PLAIN_TURNS, "two_answers": TWO_ANSWERS}

# Qwen3's targets, by hand from the template: an earlier turn is rendered without its
# reasoning, so its answer and <|im_end|>\n are what it trains; the final turn (and any after
# the last user message that has reasoning) keeps <think>…</think>, an empty one when it had
# none, and all of it is trained.
QWEN3_TARGETS = {
    "reasoning": ["4<|im_end|>\n", "<think>\nFour sides.\n</think>\n\nA square.<|im_end|>\n"],
    "plain": ["4<|im_end|>\n", "12<|im_end|>\n", "<think>\n\n</think>\n\n10<|im_end|>\n"],
    "two_answers": ["Hi.<|im_end|>\n", "<think>\nDone.\n</think>\n\nBye.<|im_end|>\n"],
}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = [json.dumps(CONVERSATIONS), "system user assistant Cutting Knowledge Date"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(corpus * 3, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS + CHAT_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("template-tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


def _hf(tokenizer_file, template):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file),
                                                chat_template=template, bos_token=BOS,
                                                eos_token="<eos>")


def _chat(name: str) -> ChatFormat:
    return ChatFormat(_template(name), name, bos_token=BOS, eos_token="<eos>")


def _our_mask(hf, rendered) -> tuple[list[int], list[int]]:
    """The text's ids and our target mask over them: the spans mapped to tokens as the index
    maps them (``token_targets`` over the tokenizer's offsets)."""
    enc = hf(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    ranges = token_targets(enc["offset_mapping"], rendered.spans)
    return enc["input_ids"], targets_mask(ranges, len(enc["input_ids"])).astype(int).tolist()


@pytest.mark.parametrize("name", PLAIN + MARKED)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_text_is_transformers_rendering(tokenizer_file, name, conversation):
    messages = CONVERSATIONS[conversation]
    flat, _ = flatten(messages)
    hf = _hf(tokenizer_file, _template(name))
    assert render(messages, _chat(name)).text == hf.apply_chat_template(flat, tokenize=False)


@pytest.mark.parametrize("name", MARKED)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_generation_blocks_give_transformers_assistant_mask(tokenizer_file, name, conversation):
    messages = CONVERSATIONS[conversation]
    hf = _hf(tokenizer_file, _template(name))
    oracle = hf.apply_chat_template(flatten(messages)[0], tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
    ids, mask = _our_mask(hf, render(messages, _chat(name)))
    assert ids == oracle["input_ids"]
    assert mask == oracle["assistant_masks"]
    assert sum(mask) > 0


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_llama3_split_is_the_mask_of_its_generation_marked_variant(tokenizer_file,
                                                                   conversation):
    """Llama 3's own template has no generation blocks; TRL's variant wraps each assistant
    turn's content and <|eot_id|> and renders the same text: transformers' mask on it is the
    oracle of the turn-by-turn split."""
    messages = CONVERSATIONS[conversation]
    marked = _hf(tokenizer_file, _template("llama3_training"))
    oracle = marked.apply_chat_template(flatten(messages)[0], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    assert not has_generation_blocks(_template("llama3"))
    ids, mask = _our_mask(_hf(tokenizer_file, _template("llama3")),
                          render(messages, _chat("llama3")))
    assert ids == oracle["input_ids"]
    assert mask == oracle["assistant_masks"]


@pytest.mark.parametrize("name", QWEN3)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_qwen3_split_is_the_hand_checked_one(name, conversation):
    rendered = render(CONVERSATIONS[conversation], _chat(name))
    assert [rendered.text[s:e] for s, e in rendered.spans] == QWEN3_TARGETS[conversation]
    if conversation == "reasoning":  # the earlier turn's reasoning is not in the text at all
        assert "Add them." not in rendered.text
        assert "<think>" not in rendered.text[:rendered.spans[0][1]]


def test_other_templates_split_where_their_turns_are():
    """Hand-checked too: Llama 3.3 trims and closes every turn with <|eot_id|>; vLLM's ChatML
    closes a message with <|im_end|> only when one follows, so an earlier answer's targets end
    where the template's last turn does (its own content, no <|im_end|>)."""
    llama = render(PLAIN_TURNS, _chat("llama3.3"))
    assert [llama.text[s:e] for s, e in llama.spans] == ["4<|eot_id|>", "12<|eot_id|>",
                                                          "10<|eot_id|>"]
    chatml = render(REASONING, _chat("chatml_vllm"))
    assert [chatml.text[s:e] for s, e in chatml.spans] == [
        _think("Add them.", "4"), _think("Four sides.", "A square.")]


def test_a_comment_naming_generation_is_no_generation_block():
    commented = "{#- wrap turns in {% generation %} some day -#}" + _template("llama3")
    assert not has_generation_blocks(commented)
    assert has_generation_blocks(_template("qwen3_training"))
    assert render(PLAIN_TURNS, ChatFormat(commented, bos_token=BOS)).spans == \
        render(PLAIN_TURNS, _chat("llama3")).spans


def test_loop_controls_compile():
    # {% break %} as in Hugging Face's environment (jinja2.ext.loopcontrols)
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                "{% if loop.index > 10 %}{% break %}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    rendered = render(PLAIN_TURNS[:2], ChatFormat(template, "loops"))
    assert [rendered.text[s:e] for s, e in rendered.spans] == ["4\n"]


# Made-up templates (not any model's): one drops earlier answers, one rewrites them.
DROPS = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
         "{{ 'A: ...\n' }}{% else %}{{ m['role'][0] | upper + ': ' + m['content'] + '\n' }}"
         "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}")
REWRITES = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
            "{{ 'A: (' + m['content'] + ')\n' }}{% else %}"
            "{{ m['role'][0] | upper + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}")


@pytest.mark.parametrize("template, reason", [
    (DROPS, "none of its content is in the text"),
    (REWRITES, "its content is not followed by the end of turn '\\\\n'")],
    ids=["drops", "rewrites"])
def test_templates_that_truly_cannot_be_split_are_refused_with_the_reason(template, reason):
    with pytest.raises(Corrupt, match=r"^message 1: the template renders earlier turns "
                                      r"differently .*\(" + reason + ";") as e:
        render(PLAIN_TURNS[:4], ChatFormat(template, "made-up"))
    assert "\n" not in str(e.value)


def test_qwen3_conversations_index_and_decode_with_the_hand_checked_targets(tokenizer_file,
                                                                           tmp_path):
    """The bug of issue #45: Qwen3's published template marked every multi-turn conversation
    corrupt at indexing. Now they index, and the decoder's labels are the tokens the
    hand-checked targets cover (located in the text by search), then <eos>."""
    names = list(CONVERSATIONS)
    members = []
    for i, name in enumerate(names):
        members.append((f"s{i}.json", json.dumps({"messages": CONVERSATIONS[name]}).encode()))
        if name == "reasoning":
            members.append((f"s{i}.0.png", _png()))
    write_tar(tmp_path / "chat" / "shard-0.tar", members)
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (tmp_path / "qwen3.jinja").write_text(_template("qwen3"), encoding="utf-8")
    spec = {"tokenizer": "tokenizer.json", "media": {"patch_size": 8},
            "sources": [{"name": "chat", "path": "chat", "format": "webdataset", "weight": 1,
                         "template": "conversation", "chat_template": "qwen3.jinja"}]}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(spec))
    index_paths([tmp_path / "mix.yaml"], workers=1, progress=False)
    spec = load_spec(tmp_path / "mix.yaml")
    rows = read_index(spec.sources[0].path).to_pylist()
    assert [r["error"] for r in rows] == [None] * len(names)
    sources = {s.name: s.path for s in spec.sources}
    decoder = SampleDecoder(SampleReader(sources), spec.tokenizer, spec.media, TokenIds(sources),
                            spec.special_tokens)
    hf = _hf(tokenizer_file, _template("qwen3"))
    eos = hf.convert_tokens_to_ids("<eos>")
    for row, name in zip(rows, names):
        text = hf.apply_chat_template(flatten(CONVERSATIONS[name])[0], tokenize=False)
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        spans, at = [], 0
        for target in QWEN3_TARGETS[name]:  # in order, each after the previous
            at = text.index(target, at)
            spans.append((at, at + len(target)))
            at += len(target)
        want = [t for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
                if any(a < e and b > s for s, e in spans)] + [eos]
        assert row["text_ids"] == enc["input_ids"]
        assert row["target_tokens"] == len(want)
        labels = decoder.decode(ref_of("chat", row)).labels_L.tolist()
        assert [t for t in labels if t != IGNORE_INDEX] == want


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 30, 10)).save(buf, "PNG")
    return buf.getvalue()
