"""``model.special_tokens`` in the run config: a stock tokenizer whose pad, eos and media
markers have other names trains once the run names them -- exactly as the demo's tokenizer
does under the default names, since the renamed tokenizer differs from it in the names only
(same ids). Without the names, the run ends with one line naming the tokenizer and the token
it lacks."""

from __future__ import annotations

import json
import shutil

import pytest

from omniscale.errors import UserError
from omniscale.index_schema import read_index_metadata
from omniscale.loaders.index import index_paths
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics

RENAMED = {"pad": "<|pad|>", "eos": "<|endoftext|>", "image": "<|image_pad|>",
           "video": "<|video_pad|>", "audio": "<|audio_pad|>"}
DEFAULTS = {"pad": "<pad>", "eos": "<eos>", "image": "<image>", "video": "<video>",
            "audio": "<audio>"}


def _renamed_tokenizer(original, out) -> None:
    """The demo's tokenizer with its special tokens renamed, every id kept."""
    tok = json.loads(original.read_text())
    rename = {DEFAULTS[role]: name for role, name in RENAMED.items()}
    for added in tok["added_tokens"]:
        added["content"] = rename.get(added["content"], added["content"])
    tok["model"]["vocab"] = {rename.get(k, k): v for k, v in tok["model"]["vocab"].items()}
    out.write_text(json.dumps(tok))


def _spec(demo, root, tokenizer) -> str:
    """A text-only spec over a copy of the demo's text source (its index is rewritten)."""
    root.mkdir()
    shutil.copytree(demo / "train" / "text", root / "text")
    shutil.copy(tokenizer, root / "tokenizer.json")
    lm = (demo / "lm.yaml").read_text()
    head, _, _ = lm.partition("sources:")
    (root / "lm.yaml").write_text(head + "sources:\n- name: text\n  path: text\n"
                                  "  format: webdataset\n  template: text\n  weight: 1\n")
    return str(root / "lm.yaml")


def _train(spec, out, names: dict[str, str] | None) -> list[dict]:
    sets = {"data.spec": spec, "data.demo": False, "eval.enabled": False, "data.workers": 0,
            "steps": 2, "checkpoint_every": 2, "output_dir": out}
    sets |= {f"model.special_tokens.{role}": name for role, name in (names or {}).items()}
    train("configs/demo_lm.yaml", nproc=1, sets=[f"{k}={v}" for k, v in sets.items()],
          progress=False)
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.timeout(240)
def test_a_tokenizer_with_other_names_trains_once_the_run_names_them(demo, tmp_path):
    _renamed_tokenizer(demo / "tokenizer.json", tmp_path / "renamed.json")
    stock = _spec(demo, tmp_path / "stock", tmp_path / "renamed.json")
    with pytest.raises(UserError) as e:  # the spec's (default) names are not in it
        _train(stock, tmp_path / "refused", None)
    assert "\n" not in str(e.value) and "'<pad>'" in str(e.value) and \
        "tokenizer.json" in str(e.value), e.value

    want = _train(_spec(demo, tmp_path / "demo", demo / "tokenizer.json"), tmp_path / "a", None)
    got = _train(stock, tmp_path / "b", RENAMED)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    # indexed with the run's names, which the loaders then checked it against
    meta = read_index_metadata(tmp_path / "stock" / "text")
    assert meta["special_tokens"] == RENAMED


def test_names_changed_between_runs_index_again_and_clash_in_one_line(demo, tmp_path):
    """A run naming the chat token as the image marker indexes the source with that name; the
    next run, back on the defaults, indexes it again (the index recorded the names only when
    they were not the defaults, and was once taken as current). Two roles named alike: one
    line."""
    spec = _spec(demo, tmp_path / "demo", demo / "tokenizer.json")
    _train(spec, tmp_path / "marker", {"image": "<|im_start|>"})
    assert read_index_metadata(tmp_path / "demo" / "text")["special_tokens"]["image"] == \
        "<|im_start|>"
    assert len(_train(spec, tmp_path / "defaults", None)) == 2
    assert "special_tokens" not in read_index_metadata(tmp_path / "demo" / "text")
    # each switch of names re-indexes every shard; the same names again, none
    for names, indexed in (({"image": "<|im_start|>"}, 2), (None, 2), (None, 0)):
        [report] = index_paths([spec], progress=False, special_tokens=names)
        assert (report.shards_total, report.shards_indexed) == (2, indexed), names
    with pytest.raises(UserError, match="each role needs a token of its own"):
        _train(spec, tmp_path / "clash", {"pad": "<eos>"})
    assert "special_tokens" not in read_index_metadata(tmp_path / "demo" / "text")  # untouched
