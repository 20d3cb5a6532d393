"""Conversation importers (``loaders.importers``): each format on hand-made records with real
media, the sample read back with the project's tar scanner, skips with file and line, and an
interrupted import finished by a rerun equal to one that ran through."""

from __future__ import annotations

import base64
import json

import pytest

from omniscale.loaders.importers import convert, import_conversations
from omniscale.loaders.importers.run import MANIFEST, file_stem
from tests.loaders.import_fixtures import (
    demo_mp4,
    jpg,
    png,
    read_source,
    skipped,
    tree,
    wav,
    write,
    write_jsonl,
    write_tar,
)


def by_line(out):
    return {s["json"]["origin"]["line"]: s for s in read_source(out).values()}


def text(t):
    return {"type": "text", "text": t}


def test_openai_parts_urls_tar_members_and_inline_audio(tmp_path, demo_root):
    src = tmp_path / "src"
    a, b, mp4, sound = png("red"), jpg("blue"), demo_mp4(demo_root), wav()
    write(src / "img" / "a.png", a)
    write(tmp_path / "elsewhere" / "b.JPG", b)
    write_tar(src / "media.tar", {"clips/c.mp4": mp4, "pics/d.png": png("green")})
    records = [
        {"id": "r0", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "compare"},
                {"type": "image", "image": "img/a.png"},
                {"type": "image_url", "image_url": {"url": (tmp_path / "elsewhere" / "b.JPG")
                                                    .as_uri()}}]},
            {"role": "assistant", "content": "red, then blue"}]},
        {"messages": [
            {"role": "user", "content": [
                {"type": "video", "video": "media.tar#clips/c.mp4"},
                {"type": "input_audio",
                 "input_audio": {"data": base64.b64encode(sound).decode(), "format": "wav"}},
                {"type": "image_url", "image_url": "media.tar#pics/d.png"},
                {"type": "text", "text": "what moves?"}]},
            {"role": "assistant", "content": ""}]},
        {"messages": [
            {"role": "developer", "content": [{"type": "text", "text": "sys"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(a).decode()}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]},
    ]
    write_jsonl(src / "chat.jsonl", records)
    report = import_conversations("openai", [src], tmp_path / "out", workers=1,
                                  progress=False)
    assert (report.samples, report.skipped, report.shards) == (3, [], 1)

    samples = by_line(tmp_path / "out")
    first = samples[1]
    assert first["json"] == {
        "messages": [
            {"role": "system", "content": [text("be brief")]},
            {"role": "user", "content": [text("compare"), {"type": "image"},
                                         {"type": "image"}]},
            {"role": "assistant", "content": [text("red, then blue")]}],
        "origin": {"file": "chat.jsonl", "line": 1, "id": "r0"}}
    assert first["members"] == {"0.png": a, "1.jpg": b}  # original bytes, extension lowercased
    second = samples[2]
    assert second["json"]["messages"] == [
        {"role": "user", "content": [{"type": "video"}, {"type": "audio"}, {"type": "image"},
                                     text("what moves?")]},
        {"role": "assistant", "content": [text("")]}]  # the empty turn is kept
    assert second["members"] == {"0.mp4": mp4, "0.wav": sound, "0.png": png("green")}
    third = samples[3]
    assert third["json"]["messages"][0] == {"role": "system", "content": [text("sys")]}
    assert third["members"] == {"0.png": a}
    stem = file_stem("chat.jsonl")  # keys: input file + record number
    assert list(read_source(tmp_path / "out")) == [f"{stem}-00000000{i}" for i in range(3)]


def test_sharegpt_markers_unmarked_items_and_a_json_array(tmp_path, demo_root):
    src = tmp_path / "src"
    a, b, sound, mp4 = png(), jpg(), wav(), demo_mp4(demo_root)
    write(src / "a.png", a)
    write(src / "b.jpg", b)
    write(src / "s.wav", sound)
    write(src / "v.mp4", mp4)
    records = [
        {"conversations": [
            {"from": "human", "value": "<image>\nfirst<image> second"},
            {"from": "gpt", "value": "two pictures"}],
         "images": ["a.png", "b.jpg"], "audio": "s.wav", "system": "you see and hear"},
        {"conversations": [{"from": "human", "value": "<image><image>"},
                           {"from": "gpt", "value": "x"}], "images": ["a.png"]},
        {"conversations": [{"from": "observation", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "what is it?"},
                           {"from": "gpt", "value": ""},
                           {"from": "human", "value": "<video>"},
                           {"from": "gpt", "value": "a clip"}], "video": "v.mp4"},
        {"conversations": [{"from": "human", "value": "caf\udce9"},
                           {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "hi"}]},
    ]
    dumped = [json.dumps(r, indent=1, ensure_ascii=False) for r in records]
    body = "[\n" + ",\n".join(dumped) + "\n]\n"
    write(src / "data.json", body.encode("utf-8", errors="surrogateescape"))
    report = import_conversations("sharegpt", [src / "data.json"], tmp_path / "out",
                                  workers=1, progress=False)
    lines = [1 + body[:body.index(d)].count("\n") for d in dumped]

    samples = by_line(tmp_path / "out")
    assert sorted(samples) == [lines[0], lines[3]]
    first = samples[lines[0]]
    assert first["json"]["messages"] == [
        {"role": "system", "content": [text("you see and hear")]},
        {"role": "user", "content": [{"type": "audio"}, {"type": "image"}, text("\nfirst"),
                                     {"type": "image"}, text(" second")]},
        {"role": "assistant", "content": [text("two pictures")]}]
    assert first["json"]["origin"] == {"file": "data.json", "line": lines[0], "index": 0}
    assert first["members"] == {"0.wav": sound, "0.png": a, "1.jpg": b}
    fourth = samples[lines[3]]
    assert [m["content"] for m in fourth["json"]["messages"]] == [
        [text("what is it?")], [text("")], [{"type": "video"}], [text("a clip")]]
    assert fourth["members"] == {"0.mp4": mp4}
    assert [(s["line"], s["index"], s["category"]) for s in report.skipped] == [
        (lines[1], 1, "markers do not match media"), (lines[2], 2, "unknown role"),
        (lines[4], 4, "not UTF-8"), (lines[5], 5, "no assistant turn")]
    assert report.skipped[0]["reason"] == "2 <image> marker(s) but 1 image item(s)"
    assert report.skipped[2]["reason"] == \
        f"not UTF-8 (byte 0xe9 on line {lines[4] + 4}, column 17)"


def test_llava_with_a_media_root(tmp_path):
    images = tmp_path / "images"
    a, b = png(), jpg()
    write(images / "coco" / "1.png", a)
    write(images / "coco" / "2.jpg", b)
    records = [
        {"id": "000001", "image": "coco/1.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"},
            {"from": "gpt", "value": "A red square."}]},
        {"id": "000002", "image": "coco/2.jpg", "conversations": [
            {"from": "human", "value": "Describe."}, {"from": "gpt", "value": "Blue."}]},
        {"id": "000003", "image": "coco/3.jpg", "conversations": [
            {"from": "human", "value": "<image>"}, {"from": "gpt", "value": "?"}]},
    ]
    write(tmp_path / "llava.json", json.dumps(records).encode())  # one line, as LLaVA's are
    report = import_conversations("llava", [tmp_path / "llava.json"], tmp_path / "out",
                                  media_root=images, progress=False)
    samples = {s["json"]["origin"]["id"]: s for s in read_source(tmp_path / "out").values()}
    assert samples["000001"]["json"]["messages"][0]["content"] == [
        {"type": "image"}, text("\nWhat is it?")]
    assert samples["000002"]["json"]["messages"][0]["content"] == [
        {"type": "image"}, text("Describe.")]
    assert samples["000001"]["members"] == {"0.png": a}
    assert samples["000002"]["members"] == {"0.jpg": b}
    assert [(s["line"], s["index"], s["category"]) for s in report.skipped] == [
        (1, 2, "missing media")]
    assert report.skipped[0]["reason"].startswith("image 'coco/3.jpg': no such file")


def test_bad_records_are_skipped_with_their_line(tmp_path, demo_root):
    src = tmp_path / "src"
    write(src / "a.png", png())
    write(src / "v.mp4", demo_mp4(demo_root))
    write_tar(src / "m.tar", {"x.png": png()})

    def chat(*user):
        return {"messages": [{"role": "user", "content": list(user)},
                             {"role": "assistant", "content": "ok"}]}

    records = [
        chat({"type": "image", "image": "a.png"}),
        chat({"type": "image", "image": "gone.png"}),
        None,  # raw line: not UTF-8
        None,  # raw line: not JSON
        {"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]},
        chat({"type": "image", "image": "v.mp4"}),
        chat({"type": "image", "image": "m.tar#y.png"}),
        chat({"type": "image", "image": "a.png"}, {"type": "image", "image": "a.png"}),
    ]
    write_jsonl(src / "bad.jsonl", records,
                raw_lines={2: b'{"messages": "\xff"}', 3: b'{"messages": ['})
    report = import_conversations("openai", [src], tmp_path / "out", progress=False)
    assert sorted(by_line(tmp_path / "out")) == [1, 8]
    assert [(s["line"], s["category"], s["reason"]) for s in report.skipped] == [
        (2, "missing media", f"image 'gone.png': no such file ({src / 'gone.png'})"),
        (3, "not UTF-8", "not UTF-8 (byte 0xff at column 15)"),
        (4, "not JSON", "not JSON (Expecting value: column 15)"),
        (5, "malformed record",
         "messages[0].content: expected a string or a list of parts, got int"),
        (6, "unsupported media", "image 'v.mp4': referenced as image, but .mp4 is video"),
        (7, "missing media", "image 'm.tar#y.png': no member 'y.png' in m.tar"),
    ]
    assert skipped(tmp_path / "out") == report.skipped
    assert report.lines()[0] == \
        f"{src / 'bad.jsonl'}:2: image 'gone.png': no such file ({src / 'gone.png'})"


def make_inputs(root):
    """Three input files, one with a skipped record, in two folders."""
    write(root / "a.png", png())
    for name in ("one.jsonl", "sub/two.jsonl", "sub/three.jsonl"):
        n = len(name)
        write_jsonl(root / name, [
            {"messages": [{"role": "user", "content": [
                {"type": "text", "text": f"{name} {i}"},
                {"type": "image", "image": "../a.png" if "/" in name else "a.png"}]},
                {"role": "assistant", "content": "y" * i}]} for i in range(n % 5 + 2)]
            + [{"messages": [{"role": "user", "content": "no answer"}]}])


def test_an_interrupted_import_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    src = tmp_path / "src"
    make_inputs(src)
    whole = import_conversations("openai", [src], tmp_path / "whole", samples_per_shard=2,
                                 workers=2, progress=False)  # in worker processes
    assert whole.files_converted == 3 and len(whole.skipped) == 3

    calls, real_add = [], convert.ShardWriter.add

    def add_then_die(self, key, members):  # ^C in the second file, its first shard written
        calls.append(key)
        if len(calls) == 9:
            raise KeyboardInterrupt
        real_add(self, key, members)

    monkeypatch.setattr(convert.ShardWriter, "add", add_then_die)
    with pytest.raises(KeyboardInterrupt):
        import_conversations("openai", [src], tmp_path / "cut", samples_per_shard=2,
                             workers=1, progress=False)
    monkeypatch.setattr(convert.ShardWriter, "add", real_add)
    cut = tmp_path / "cut"
    manifest = json.loads((cut / MANIFEST).read_text())
    assert list(manifest["files"]) == ["one.jsonl"]  # the biggest file went first
    assert not list(cut.glob(".*"))  # the second file's partial shards were removed
    write(cut / ".left-by-a-kill.tar.part", b"junk")  # as a hard kill would leave

    resumed = import_conversations("openai", [src], cut, samples_per_shard=2, workers=1,
                                   progress=False)
    assert resumed.files_converted == 2
    assert tree(cut) == tree(tmp_path / "whole")
    assert (resumed.samples, resumed.shards, resumed.skipped) == \
        (whole.samples, whole.shards, whole.skipped)


def test_a_rerun_follows_changed_and_removed_inputs(tmp_path):
    src = tmp_path / "src"
    make_inputs(src)
    out = tmp_path / "out"
    import_conversations("openai", [src], out, samples_per_shard=1, progress=False)
    again = import_conversations("openai", [src], out, samples_per_shard=1, progress=False)
    assert again.files_converted == 0
    write_jsonl(src / "sub" / "two.jsonl", [{"messages": [
        {"role": "user", "content": "changed"}, {"role": "assistant", "content": "ok"}]}])
    (src / "one.jsonl").unlink()
    rerun = import_conversations("openai", [src], out, samples_per_shard=1, progress=False)
    assert rerun.files_converted == 1
    fresh = import_conversations("openai", [src], tmp_path / "fresh", samples_per_shard=1,
                                 progress=False)
    assert tree(out) == tree(tmp_path / "fresh") and fresh.samples == rerun.samples


def test_media_extensions_come_from_the_name_or_the_bytes(tmp_path):
    from omniscale.loaders.importers.media import MediaFetcher, MediaRef
    from omniscale.loaders.importers.records import Skip

    write(tmp_path / "photo.bin", jpg())
    write(tmp_path / "noext", png())
    write(tmp_path / "Loud.WAV", wav())
    write(tmp_path / "empty.png", b"")
    fetcher = MediaFetcher(tmp_path)
    assert fetcher.fetch(MediaRef("image", "photo.bin")) == ("jpg", jpg())
    assert fetcher.fetch(MediaRef("image", (tmp_path / "noext").as_uri())) == ("png", png())
    assert fetcher.fetch(MediaRef("audio", "Loud.WAV")) == ("wav", wav())
    with pytest.raises(Skip, match=r"^image 'empty.png': empty$"):
        fetcher.fetch(MediaRef("image", "empty.png"))
    with pytest.raises(Skip, match=r"^audio 'noext': referenced as audio, but .png is image$"):
        fetcher.fetch(MediaRef("audio", "noext"))
