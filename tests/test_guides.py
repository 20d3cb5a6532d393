"""Every command block of a guide (``docs/guides/*.md``) runs, in order, as a user runs it.

A page's ```` ```bash ```` blocks run one after the other in one bash process (``set -euo
pipefail``) in a fresh directory, with ``omniscale`` and ``python`` from this checkout's
environment. What a CPU test cannot have -- the real checkpoints, a bucket, GPUs, a Slurm
cluster -- is swapped for its tiny stand-in by a **marked substitution**: an HTML comment on
the line before the block, ``<!-- test: "OLD" -> "NEW"; ... -->``, each OLD required to occur
in the block (so a stale substitution fails too). ``<!-- test: gpu-only -->`` marks a block
that cannot run here; it is listed, never silently skipped.

The stand-ins the guides name: ``demo/`` (the tiny demo: its tokenizer and sources), tiny
Hugging Face checkpoints under ``models/`` built by transformers (no downloads), the local S3
server (``$GUIDE_S3_ENDPOINT``, a fresh bucket ``$GUIDE_BUCKET``, its credentials in the
environment), this checkout (``$GUIDE_REPO``: its demo config) and two free local ports
(``$GUIDE_PORT``, ``$GUIDE_METRICS_PORT``). A block that starts a process in the background
ends it itself; the whole page runs under a time limit, and a failure shows the tail of every
``*.log`` the page wrote.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import free_port
from tests.s3_fixtures import new_bucket, s3_fixture, s3_server_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
BLOCK = re.compile(r"(?:<!--\s*test:(?P<marker>.*?)-->\s*\n)?```bash\n(?P<body>.*?)```", re.S)
PAIR = re.compile(r'"((?:[^"\\]|\\.)*)"\s*->\s*"((?:[^"\\]|\\.)*)"')


def blocks(page: Path) -> list[tuple[str, str | None]]:
    """(the block as the test runs it, or None for a GPU-only block; the marker) in order."""
    out = []
    for match in BLOCK.finditer(page.read_text()):
        body, marker = match["body"], (match["marker"] or "").strip()
        if marker == "gpu-only":
            out.append((None, marker))
            continue
        for old, new in PAIR.findall(marker):
            old, new = json.loads(f'"{old}"'), json.loads(f'"{new}"')  # \" and \\ as in JSON
            assert old in body, f"{page.name}: substitution {old!r} not in its block"
            body = body.replace(old, new)
        out.append((body, marker))
    return out


def test_the_marker_grammar():
    page = ("x\n<!-- test: \"/models/\" -> \"models/\"; \"a \\\"b\\\"\" -> \"c\" -->\n"
            "```bash\necho /models/q a \"b\"\n```\n\n<!-- test: gpu-only -->\n```bash\nnvidia-smi\n"
            "```\n```bash\necho plain\n```\n")
    path = Path("/tmp") / f"guide-grammar-{os.getpid()}.md"
    path.write_text(page)
    try:
        got = blocks(path)
    finally:
        path.unlink()
    assert [b for b, _ in got] == ["echo models/q c\n", None, "echo plain\n"]


def _tiny_checkpoints(models: Path, vocab: int) -> None:
    """A tiny Qwen3 and a tiny Qwen2-VL (vision merger out to the Qwen3's width), as
    ``save_pretrained`` writes them: the stand-ins for /models/Qwen3-8B and
    /models/Qwen2-VL-7B."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    ).save_pretrained(models / "Qwen3-8B")
    transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2),
        text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         eos_token_id=1, bos_token_id=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 6],
                                          "rope_theta": 1e6}))
    ).save_pretrained(models / "Qwen2-VL-7B")


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.name)
def test_every_command_block_of_the_guide_runs(page, demo_root, s3, tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    runnable = [(body, marker) for body, marker in blocks(page) if body is not None]
    assert runnable, f"{page.name}: no command block"
    shutil.copytree(demo_root, tmp_path / "demo")
    vocab = Tokenizer.from_file(str(tmp_path / "demo" / "tokenizer.json")).get_vocab_size()
    _tiny_checkpoints(tmp_path / "models", vocab)
    bucket = new_bucket(s3)
    script = ["set -euo pipefail"]
    for i, (body, _) in enumerate(runnable):
        script += [f'echo "### block {i + 1}" >&2', body]
    env = {**os.environ, "GUIDE_S3_ENDPOINT": s3.endpoint, "GUIDE_BUCKET": bucket,
           "GUIDE_REPO": str(ROOT), "GUIDE_PORT": str(free_port()),
           "GUIDE_METRICS_PORT": str(free_port()),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    logs = "".join(f"\n--- {log.name}:\n{log.read_text(errors='replace')[-1500:]}"
                   for log in sorted(tmp_path.glob("*.log")))  # what it ran in the background
    assert done.returncode == 0, (f"{page.name}: {done.stderr[-3000:]}\n--- stdout:\n"
                                  f"{done.stdout[-2000:]}{logs}")
    if page.name == "operate-plane.md":
        _the_plane_died_mid_run(tmp_path)


def _the_plane_died_mid_run(work: Path) -> None:
    """The guide's kill -9 must land while the trainers train (its audit and `wait` then prove
    nothing was lost or repeated, and that the trainers rode out the restart): the restarted
    plane resumed at a step before the run's last, and the run trained every step once."""
    restarted = re.findall(r"serving \S+ \(step (\d+)", (work / "plane.log").read_text())
    assert restarted and 0 < int(restarted[0]) < 10, restarted
    rows = [json.loads(line) for line in (work / "runs/ft/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10))
