"""``omniscale data import`` from the command line: each skipped record one ``file:line:
reason`` line, a summary, exit 3 when any were skipped, and bad arguments one line."""

from __future__ import annotations

import json

import pytest

from omniscale.tools.cli import main
from tests.loaders.import_fixtures import png, read_source, write, write_jsonl


def chat(image: str) -> dict:
    return {"conversations": [{"from": "human", "value": "<image>\nwhat?"},
                              {"from": "gpt", "value": "red"}], "image": image}


def test_skips_are_reported_and_exit_3(tmp_path, capsys):
    write(tmp_path / "a.png", png())
    data = write_jsonl(tmp_path / "data.jsonl", [chat("a.png"), chat("gone.png"), chat("a.png")],
                       raw_lines={2: b"\xff\xfe"})
    out = tmp_path / "out"
    code = main(["data", "import", "sharegpt", str(data), "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 3
    assert captured.err.splitlines() == [
        f"{data}:2: image 'gone.png': no such file ({tmp_path / 'gone.png'})",
        f"{data}:3: not UTF-8 (byte 0xff at column 1)",
        "omniscale: 2 record(s) skipped (--allow-skipped exits 0)"]
    assert captured.out.startswith("imported 1 conversation(s) from 1 file(s)")
    assert "skipped 2 (missing media: 1, not UTF-8: 1)" in captured.out
    assert [s["json"]["origin"]["line"] for s in read_source(out).values()] == [1]
    assert [json.loads(s)["line"] for s in (out / "_skipped.jsonl").read_text().splitlines()] \
        == [2, 3]

    again = main(["data", "import", "sharegpt", str(data), "--out", str(out), "--no-progress",
                  "--allow-skipped"])
    captured = capsys.readouterr()
    assert again == 0 and "(0 converted now, 1 done before)" in captured.out
    assert len(captured.err.splitlines()) == 2  # the skips are still reported


@pytest.mark.parametrize("args, message", [
    (["bogus", "{src}", "--out", "{out}"],
     "unknown format 'bogus' (one of openai, sharegpt, llava)"),
    (["openai", "{tmp}/nope", "--out", "{out}"], "{tmp}/nope: no such file or directory"),
    (["openai", "{src}", "--out", "{out}", "--samples-per-shard", "0"],
     "--samples-per-shard: must be >= 1, got 0"),
    (["openai", "{src}", "--out", "{out}", "--workers", "0"], "--workers: must be >= 1, got 0"),
    (["openai", "{src}", "--out", "{tmp}"],
     "--out {tmp}: not empty, and not an import's output (no _import.json); name a new or "
     "empty directory"),
    (["openai", "{src}", "--out", "{src}"], "--out {src}: not a directory"),
    (["llava", "{src}", "--out", "{out}", "--media-root", "{tmp}/nope"],
     "--media-root {tmp}/nope: no such directory"),
])
def test_bad_arguments_are_one_line(tmp_path, capsys, args, message):
    src = write_jsonl(tmp_path / "in.jsonl", [chat("a.png")])
    fill = {"src": src, "out": tmp_path / "out", "tmp": tmp_path}
    assert main(["data", "import", *(a.format(**fill) for a in args)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"omniscale: error: {message.format(**fill)}"]


def test_other_settings_are_refused_not_mixed(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [chat("a.png")])
    out = tmp_path / "out"
    main(["data", "import", "sharegpt", str(src), "--out", str(out), "--no-progress"])
    capsys.readouterr()
    assert main(["data", "import", "llava", str(src), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"omniscale: error: --out {out}: holds an import made with format 'sharegpt'; rerun it "
        "with the same arguments to resume it, or --force to start over"]
    assert main(["data", "import", "llava", str(src), "--out", str(out), "--force",
                 "--no-progress"]) == 3
