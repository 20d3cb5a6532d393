"""A tokenizer with special tokens of other names (``special_tokens:`` in the mixing spec):
indexing and decoding a source whose texts mark media with those names give exactly what the
default names give with a tokenizer that differs only in them; a name the tokenizer lacks, two
roles sharing a token, or an index made with other names are one line each."""

from __future__ import annotations

import io
import tarfile

import pytest
import yaml
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from omniscale.dataplane.spec import SpecError, load_spec
from omniscale.errors import UserError
from omniscale.index_schema import read_index
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, SpecialTokens
from omniscale.loaders.index import index_paths
from omniscale.loaders.token_ids import check_tokenizer
from tests.loaders.decode_fixtures import demo_decoder, ref_of

QWEN_LIKE = SpecialTokens(pad="<|endoftext|>", eos="<|im_end|>", image="<|image_pad|>",
                          video="<|video_pad|>", audio="<|audio_pad|>")
TEXTS = ["A photo {image} of a red square on a blue field.",
         "Two shapes: {image} a circle and {image} a triangle, both green.",
         "no media here, only words about squares and circles"]
CORPUS = [t.format(image="") for t in TEXTS] * 3


def _tokenizer(path, special: SpecialTokens) -> None:
    """The same byte-level BPE (same corpus, same order of special tokens) under other names."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=special.names(), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


def _source(root, special: SpecialTokens, texts: list[str] = TEXTS, images: int | None = None):
    """A WebDataset shard: each text with its markers in ``special``'s names, and its images
    (as many as it marks, or ``images``)."""
    root.mkdir()
    with tarfile.open(root / "shard-0.tar", "w") as tar:
        for i, text in enumerate(texts):
            members = {f"s{i}.txt": text.format(image=special.image).encode()}
            for j in range(text.count("{image}") if images is None else images):
                buf = io.BytesIO()
                Image.new("RGB", (40 + 8 * j, 32), (200, 30 * j, 10)).save(buf, "PNG")
                members[f"s{i}.{j}.png"] = buf.getvalue()
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _spec(root, special: SpecialTokens | None):
    root.mkdir(parents=True)
    _tokenizer(root / "tokenizer.json", special or DEFAULT_SPECIAL_TOKENS)
    _source(root / "src", special or DEFAULT_SPECIAL_TOKENS)
    spec = {"tokenizer": "tokenizer.json", "media": {"patch_size": 8},
            "sources": [{"name": "src", "path": "src", "format": "webdataset", "weight": 1,
                         "template": "interleaved"}]}
    if special is not None:
        spec["special_tokens"] = dict(vars(special))
    (root / "mix.yaml").write_text(yaml.safe_dump(spec))
    return root / "mix.yaml"


def _decoded(spec_path):
    index_paths([spec_path], workers=1, progress=False)
    spec = load_spec(spec_path)
    rows = read_index(spec.sources[0].path).to_pylist()
    assert all(r["error"] is None for r in rows)
    decoder = demo_decoder(spec)
    return rows, [decoder.decode(ref_of("src", r)) for r in rows]


def test_other_names_index_and_decode_as_the_defaults_do(tmp_path):
    rows, samples = _decoded(_spec(tmp_path / "qwen", QWEN_LIKE))
    want_rows, want = _decoded(_spec(tmp_path / "default", None))
    features = ("llm_tokens", "text_tokens", "image_patches")
    assert [[r[f] for f in features] for r in rows] == \
        [[r[f] for f in features] for r in want_rows]
    assert sum(len(r["image_patches"]) for r in rows) == 3
    for got, expected in zip(samples, want, strict=True):
        assert got.input_ids_L.tolist() == expected.input_ids_L.tolist()
        assert got.labels_L.tolist() == expected.labels_L.tolist()
        assert len(got.media) == len(expected.media)
    image_id = Tokenizer.from_file(str(tmp_path / "qwen" / "tokenizer.json")).token_to_id(
        QWEN_LIKE.image)
    assert image_id in samples[0].input_ids_L.tolist()  # the placeholders are that token


def test_bad_special_tokens_are_one_line(tmp_path):
    spec = _spec(tmp_path / "qwen", QWEN_LIKE)
    raw = yaml.safe_load(spec.read_text())
    raw["special_tokens"]["eos"] = "<|nope|>"
    spec.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match=r"tokenizer\.json: has no token '<\|nope\|>' "
                                        r"\(special_tokens\.eos: name a token"):
        index_paths([spec], workers=1, progress=False)

    raw["special_tokens"]["eos"] = raw["special_tokens"]["pad"]
    spec.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"special_tokens: each role needs a token of its own"):
        load_spec(spec)

    raw["special_tokens"] = {"end": "<|im_end|>"}
    spec.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"special_tokens\.end: unknown key"):
        load_spec(spec)


def test_an_index_made_with_other_names_is_refused(tmp_path):
    spec_path = _spec(tmp_path / "qwen", QWEN_LIKE)
    index_paths([spec_path], workers=1, progress=False)
    spec = load_spec(spec_path)
    sources = {"src": spec.sources[0].path}
    check_tokenizer(sources, spec.tokenizer, QWEN_LIKE)  # the names it was indexed with
    other = SpecialTokens(**{**vars(QWEN_LIKE), "eos": "<|endoftext|>", "pad": "<|im_end|>"})
    with pytest.raises(UserError, match=r"was indexed with special tokens \['<\|endoftext\|>', "
                                        r"'<\|im_end\|>'.*re-run `omniscale data index`"):
        check_tokenizer(sources, spec.tokenizer, other)


def test_markers_that_do_not_match_the_media_are_corrupt_under_other_names(tmp_path):
    spec_path = _spec(tmp_path / "qwen", QWEN_LIKE)
    _source(tmp_path / "qwen" / "bad", QWEN_LIKE, ["two {image} marks {image}, one image"], 1)
    raw = yaml.safe_load(spec_path.read_text())
    raw["sources"][0]["path"] = "bad"
    spec_path.write_text(yaml.safe_dump(raw))
    index_paths([spec_path], workers=1, progress=False)
    rows = read_index(load_spec(spec_path).sources[0].path).to_pylist()
    assert "text has 2 <|image_pad|> marker(s) but the sample has 1 image member(s)" in \
        rows[0]["error"]
