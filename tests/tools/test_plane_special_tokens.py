"""Special tokens and an external plane (issue #45 item 9). The plane budgets each sample with
its index's token count, and that count leaves the media markers out: the demo's interleaved
texts hold ``<image>`` markers, so an index made with another image marker counts them as
text and the plane plans other steps. The plane's status says which special tokens each
source's index was made with; a trainer whose tokens (``model.special_tokens`` over the spec's
``special_tokens:``) differ refuses the plane in one line naming both, and a plane started
with the flags ``plane_args`` prints plans with the run's tokens.

In-process planes and servers on a one-source copy of the demo: no subprocess, no sleep."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil

import pytest

from omniscale.dataplane.plane import DataPlane
from omniscale.dataplane.server import PlaneServer
from omniscale.errors import UserError
from omniscale.index_schema import read_index
from omniscale.layout import DEFAULT_SPECIAL_TOKENS
from omniscale.loaders.index import index_paths
from omniscale.tools.train.launch import check_plane

DEFAULTS = dataclasses.asdict(DEFAULT_SPECIAL_TOKENS)
# a token the demo tokenizer has that its interleaved texts never hold
RUN_IMAGE = "<|im_start|>"
RUN_TOKENS = {**DEFAULTS, "image": RUN_IMAGE}
CONFIG = "configs/demo_omni.yaml"


@pytest.fixture
def spec(demo, tmp_path):
    """A spec over a copy of the demo's interleaved source (indexed with the defaults)."""
    root = tmp_path / "data"
    root.mkdir()
    shutil.copytree(demo / "train" / "interleaved", root / "interleaved")
    shutil.copy(demo / "tokenizer.json", root / "tokenizer.json")
    head, _, _ = (demo / "mix.yaml").read_text().partition("sources:")
    (root / "mix.yaml").write_text(head + "sources:\n- name: interleaved\n  path: interleaved\n"
                                   "  format: webdataset\n  template: interleaved\n"
                                   "  weight: 1\n")
    return root / "mix.yaml"


def _sets(spec, tmp_path, image: str | None = None) -> list[str]:
    sets = [f"data.spec={spec}", "data.demo=false", "eval.enabled=false", "data.workers=0",
            f"output_dir={tmp_path / 'run'}"]
    return sets + ([f"model.special_tokens.image={image}"] if image else [])


def _plane_flags(sets: list[str], capsys) -> list[str]:
    """What ``python -m omniscale.tools.launch.plane_args --world 1 CONFIG ...`` prints."""
    from omniscale.tools.launch.plane_args import main

    capsys.readouterr()
    assert main(["--world", "1", CONFIG, *[a for s in sets for a in ("--set", s)]]) == 0
    return capsys.readouterr().out.split("\n")


def _plane(flags: list[str], state) -> DataPlane:
    """``omniscale plane serve`` with ``flags``, in this process, its state in ``state``."""
    from omniscale.tools.cli import build_parser
    from omniscale.tools.plane_cli import serve_config

    args = build_parser().parse_args(["plane", "serve", *flags, "--state-dir", str(state)])
    return DataPlane(args.spec, state, serve_config(args))


@contextlib.contextmanager
def _served(plane: DataPlane):
    server = PlaneServer(plane).start()
    try:
        yield server.url
    finally:
        server.stop()


def _planned_tokens(plane: DataPlane, steps: int = 4) -> list[list[int]]:
    """Each planned step's samples' LLM tokens, as the plane budgeted them."""
    return [plane.get_plan(step, 0).column("llm_tokens").to_pylist() for step in range(steps)]


def test_the_plane_plans_with_its_index_tokens_and_says_which(spec, tmp_path):
    """Evidence that planning depends on the special tokens: the same source indexed with
    another image marker gives other budgets; the status names each index's tokens."""
    flags = ["--spec", str(spec), "--dp", "1", "--global-batch-tokens", "8192",
             "--micro-batch-tokens", "4096"]
    before = read_index(spec.parent / "interleaved", columns=["text_tokens"])
    default = _plane(flags, tmp_path / "a")
    assert default.status()["special_tokens"] == {"interleaved": DEFAULTS}
    index_paths([spec], progress=False, special_tokens={"image": RUN_IMAGE})
    after = read_index(spec.parent / "interleaved", columns=["text_tokens"])
    # the ``<image>`` markers of each text now count as text: one token each, by hand
    markers = [text.count("<image>") for text in _texts(spec.parent / "interleaved")]
    assert sum(markers) > 0
    got = [a - b for a, b in zip(after.column("text_tokens").to_pylist(),
                                 before.column("text_tokens").to_pylist())]
    assert sorted(got) == sorted(markers)
    renamed = _plane(flags, tmp_path / "b")
    assert renamed.status()["special_tokens"] == {"interleaved": RUN_TOKENS}
    assert _planned_tokens(renamed) != _planned_tokens(default)


def _texts(source) -> list[str]:
    """Every sample's text member, read straight from the shards."""
    import tarfile

    texts = []
    for shard in sorted(source.glob("*.tar")):
        with tarfile.open(shard) as tar:
            texts += [tar.extractfile(m).read().decode() for m in tar.getmembers()
                      if m.name.endswith(".txt")]
    return texts


def test_plane_args_flags_plan_with_the_run_tokens_and_another_plane_is_refused(
        spec, tmp_path, capsys):
    sets = _sets(spec, tmp_path, image=RUN_IMAGE)
    from omniscale.tools.train.config import load_config

    cfg, _ = load_config(CONFIG, sets)
    flags = _plane_flags(sets, capsys)  # indexes with the run's tokens, as its trainer would
    plane = _plane(list(filter(None, flags)), tmp_path / "fits")
    assert plane.status()["special_tokens"] == {"interleaved": RUN_TOKENS}
    with _served(plane) as url:
        check_plane(url, None, cfg, 1, 0)  # accepted

    index_paths([spec], progress=False)  # `omniscale data index` of the spec: its own tokens
    stale = _plane(list(filter(None, flags)), tmp_path / "stale")
    with _served(stale) as url, pytest.raises(UserError) as refused:
        check_plane(url, None, cfg, 1, 0)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(
        f"--plane {url}: the plane plans source 'interleaved' with special tokens "
        f'{{"pad": "<pad>", "eos": "<eos>", "image": "<image>", "video": "<video>", '
        f'"audio": "<audio>"}} (its index\'s), this run\'s are {{"pad": "<pad>", '
        f'"eos": "<eos>", "image": "<|im_start|>", "video": "<video>", "audio": "<audio>"}} '
        "(model.special_tokens over the spec's special_tokens:)"), message
