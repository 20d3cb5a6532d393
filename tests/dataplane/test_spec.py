"""Mixing-spec loading: a valid spec round-trips; every malformed one fails with ONE line naming
the file and the field."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omniscale.dataplane.spec import SpecError, load_spec, parse_spec
from omniscale.errors import UserError

REPO = Path(__file__).resolve().parents[2]

BASE = {
    "seed": 7,
    "tokenizer": "tok/tokenizer.json",
    "accounting": "samples",
    "media": {"patch_size": 8, "max_pixels": 16384},
    "sources": [
        {"name": "text", "path": "train/text", "format": "webdataset", "template": "text"},
        {"name": "docs", "path": "train/docs", "format": "parquet", "template": "text",
         "on_exhausted": "stop"},
    ],
    "schedule": {"unit": "steps", "segments": [
        {"kind": "const", "start": 0, "end": 100, "weights": {"text": 3, "docs": 1}},
        {"kind": "linear", "start": 100, "end": 400, "from": {"text": 3, "docs": 1},
         "to": {"text": 1, "docs": 1}},
        {"kind": "step", "start": 400, "end": None, "at": 500, "from": {"text": 1, "docs": 1},
         "to": {"docs": 1}},
    ]},
}


def write(root: Path, data) -> Path:
    path = root / "mix.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def test_valid_spec_round_trips_with_paths_resolved_against_the_file(root, monkeypatch):
    monkeypatch.chdir(root.parent)  # relative to the spec, not to the working directory
    spec = load_spec(write(root, BASE))
    assert spec.seed == 7 and spec.accounting == "samples" and spec.on_exhausted == "next_epoch"
    assert spec.root == root
    assert spec.tokenizer == root / "tok" / "tokenizer.json"
    assert spec.source_names == ("text", "docs")
    assert [s.path for s in spec.sources] == [root / "train" / "text", root / "train" / "docs"]
    assert [s.on_exhausted for s in spec.sources] == ["next_epoch", "stop"]
    assert spec.media.patch_size == 8 and spec.media.max_pixels == 16384
    assert spec.media.merge_size == 2  # untouched defaults
    assert spec.schedule.boundaries == (0, 100, 400)
    assert spec.schedule.weights_at(250) == {"text": 0.625, "docs": 0.375}
    assert spec.schedule.weights_at(600) == {"text": 0.0, "docs": 1.0}


def test_defaults_and_per_source_weights(root):
    data = {"tokenizer": "tok/tokenizer.json", "sources": [
        {"name": "text", "path": "train/text", "format": "jsonl", "template": "text",
         "weight": 1},
        {"name": "docs", "path": "train/docs", "format": "parquet", "template": "text",
         "weight": 3.0}]}
    spec = load_spec(write(root, data))
    assert spec.seed == 0 and spec.accounting == "tokens"
    assert spec.schedule.weights_at(10**6) == {"text": 0.25, "docs": 0.75}


def test_check_paths_false_skips_the_filesystem(tmp_path):
    spec = parse_spec(copy.deepcopy(BASE), "elsewhere/mix.yaml", root=tmp_path,
                      check_paths=False)
    assert spec.sources[0].path == tmp_path / "train" / "text"


def test_the_documented_example_is_valid(tmp_path):
    text = (REPO / "docs" / "mixing-spec.md").read_text()
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    spec = parse_spec(yaml.safe_load(example), root=tmp_path, check_paths=False)
    assert spec.schedule.weights_at(950) == {"text": 0.5, "docs": 0.5, "web_images": 0.0,
                                             "chat": 0.0}
    assert spec.sources[1].location.url == "s3://corpus/web_images"


def mutate(fn):
    data = copy.deepcopy(BASE)
    fn(data)
    return data


def seg(i):
    return lambda d: d["schedule"]["segments"][i]


BAD = [
    # (id, spec text or mutated dict, field the message must name, extra text it must hold)
    ("missing source path", mutate(lambda d: d["sources"][0].pop("path")),
     "sources[0].path", "required"),
    ("source path missing on disk", mutate(lambda d: d["sources"][1].update(path="train/x")),
     "sources[1].path", "'train/x' does not exist"),
    ("unknown top-level key", mutate(lambda d: d.update(colour="red")), "colour", "unknown key"),
    ("unknown source key", mutate(lambda d: d["sources"][1].update(colour="red")),
     "sources[1].colour", "unknown key"),
    ("unknown segment key", mutate(lambda d: seg(0)(d).update(ramp=1)),
     "schedule.segments[0].ramp", "unknown key"),
    ("weights on a linear segment", mutate(lambda d: seg(1)(d).update(weights={"text": 1})),
     "schedule.segments[1].weights", "unknown key"),
    ("unknown media key", mutate(lambda d: d["media"].update(dpi=3)), "media.dpi",
     "unknown key"),
    ("negative weight", mutate(lambda d: seg(0)(d)["weights"].update(text=-1)),
     "schedule.segments[0].weights.text", "must be >= 0, got -1"),
    ("all-zero weights", mutate(lambda d: seg(1)(d).update(to={"text": 0, "docs": 0})),
     "schedule.segments[1].to", "all weights are 0"),
    ("NaN weight", mutate(lambda d: seg(0)(d)["weights"].update(docs=float("nan"))),
     "schedule.segments[0].weights.docs", "finite"),
    ("inf weight", mutate(lambda d: seg(2)(d)["from"].update(docs=float("inf"))),
     "schedule.segments[2].from.docs", "finite"),
    ("unknown source in weights", mutate(lambda d: seg(2)(d)["to"].update(web=1)),
     "schedule.segments[2].to.web", "unknown source 'web'"),
    ("overlapping segments", mutate(lambda d: seg(1)(d).update(start=90)),
     "schedule.segments[1].start", "overlaps segments[0]"),
    ("reversed segments", mutate(lambda d: d["schedule"]["segments"].reverse()),
     "schedule.segments[0].start", "must start at 0"),
    ("unordered segments", mutate(lambda d: seg(2)(d).update(start=50, at=60)),
     "schedule.segments[2].start", "out of order"),
    ("segment before its predecessor", mutate(lambda d: (seg(1)(d).update(start=0, end=100),
                                                         seg(0)(d).update(start=0, end=50))),
     "schedule.segments[1].start", "overlaps"),
    ("gap", mutate(lambda d: seg(1)(d).update(start=110)),
     "schedule.segments[1].start", "gap after segments[0]"),
    ("first segment not at 0", mutate(lambda d: seg(0)(d).update(start=10)),
     "schedule.segments[0].start", "must start at 0"),
    ("open segment not last", mutate(lambda d: seg(0)(d).update(end=None)),
     "schedule.segments[0].end", "only the last segment"),
    ("linear without end", mutate(lambda d: (seg(1)(d).update(end=None),
                                             d["schedule"]["segments"].pop())),
     "schedule.segments[1].end", "needs an end"),
    ("end before start", mutate(lambda d: seg(1)(d).update(end=100)),
     "schedule.segments[1].end", "must be > start"),
    ("step at before start", mutate(lambda d: seg(2)(d).update(at=300)),
     "schedule.segments[2].at", "must be >= start (400)"),
    ("step at at end", mutate(lambda d: seg(2)(d).update(end=500)),
     "schedule.segments[2].at", "< end (500)"),
    ("step without at", mutate(lambda d: seg(2)(d).pop("at")), "schedule.segments[2].at",
     "required"),
    ("unknown format", mutate(lambda d: d["sources"][0].update(format="tfrecord")),
     "sources[0].format", "unknown format 'tfrecord' (expected webdataset, parquet or jsonl)"),
    ("unknown template", mutate(lambda d: d["sources"][1].update(template="speech")),
     "sources[1].template", "unknown template 'speech'"),
    ("unknown accounting", mutate(lambda d: d.update(accounting="bytes")), "accounting",
     "expected samples, tokens or target_tokens"),
    ("unknown unit", mutate(lambda d: d["schedule"].update(unit="epochs")), "schedule.unit",
     "unknown unit 'epochs'"),
    ("unknown on_exhausted", mutate(lambda d: d["sources"][0].update(on_exhausted="loop")),
     "sources[0].on_exhausted", "expected next_epoch, stop or drop_source"),
    ("unknown kind", mutate(lambda d: seg(1)(d).update(kind="exp")),
     "schedule.segments[1].kind", "unknown kind 'exp' (expected const, linear, cosine or step)"),
    ("missing kind", mutate(lambda d: seg(1)(d).pop("kind")), "schedule.segments[1].kind",
     "required"),
    ("duplicate source names", mutate(lambda d: d["sources"][1].update(name="text")),
     "sources[1].name", "duplicate name 'text' (also sources[0])"),
    ("bad name characters", mutate(lambda d: d["sources"][0].update(name="web text")),
     "sources[0].name", "must match [A-Za-z0-9_-]+"),
    ("missing tokenizer", mutate(lambda d: d.pop("tokenizer")), "tokenizer", "required"),
    ("tokenizer missing on disk", mutate(lambda d: d.update(tokenizer="nope.json")),
     "tokenizer", "'nope.json' does not exist"),
    ("schedule and per-source weights", mutate(lambda d: d["sources"][0].update(weight=1)),
     "sources[0].weight", "not allowed together with a schedule"),
    ("neither schedule nor weights", mutate(lambda d: d.pop("schedule")), "schedule",
     "required"),
    ("only some sources weighted", mutate(lambda d: (d.pop("schedule"),
                                                     d["sources"][0].update(weight=1))),
     "sources[1].weight", "required"),
    ("per-source weights all zero", mutate(lambda d: (d.pop("schedule"),
                                                      d["sources"][0].update(weight=0),
                                                      d["sources"][1].update(weight=0))),
     "sources", "every weight is 0"),
    ("negative per-source weight", mutate(lambda d: (d.pop("schedule"),
                                                     d["sources"][0].update(weight=1),
                                                     d["sources"][1].update(weight=-2))),
     "sources[1].weight", "must be >= 0"),
    ("media patch_size 0", mutate(lambda d: d["media"].update(patch_size=0)),
     "media.patch_size", "must be > 0"),
    ("media min above max", mutate(lambda d: d["media"].update(min_pixels=10**6)),
     "media.min_pixels", "<= media.max_pixels"),
    ("media wrong type", mutate(lambda d: d["media"].update(patch_size="big")),
     "media.patch_size", "must be an integer"),
    ("weights a string", mutate(lambda d: seg(0)(d).update(weights="text")),
     "schedule.segments[0].weights", "must be a mapping"),
    ("weight a string", mutate(lambda d: seg(0)(d)["weights"].update(text="3")),
     "schedule.segments[0].weights.text", "must be a number"),
    ("weight key a number", mutate(lambda d: seg(0)(d).update(weights={1: 3})),
     "schedule.segments[0].weights.1", "must be a string"),
    ("start negative", mutate(lambda d: seg(0)(d).update(start=-5)),
     "schedule.segments[0].start", "must be >= 0, got -5"),
    ("exponent read as string", mutate(lambda d: seg(0)(d).update(end="1e9")),
     "schedule.segments[0].end", "write 1.0e9"),
    ("seed a boolean", mutate(lambda d: d.update(seed=True)), "seed", "must be an integer"),
    ("sources a mapping", mutate(lambda d: d.update(sources={"text": 1})), "sources",
     "must be a list"),
    ("no sources", mutate(lambda d: d.update(sources=[])), "sources", "must not be empty"),
    ("no segments", mutate(lambda d: d["schedule"].update(segments=[])),
     "schedule.segments", "must not be empty"),
    ("invalid YAML", "seed: 1\nsources:\n  - name: [a\n", "invalid YAML at line", "column"),
    ("duplicate YAML key", "seed: 1\nseed: 2\n", "duplicate key 'seed'", "line 2"),
    ("empty file", "", "empty file", ""),
    ("comments only", "# nothing here\n", "empty file", ""),
    ("top level a list", "- a\n- b\n", "top level must be a mapping", "a list"),
    ("top level a string", "hello\n", "top level must be a mapping", "a string"),
]


@pytest.mark.parametrize("data, field, detail", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_spec_is_one_line_naming_file_and_field(root, data, field, detail):
    path = write(root, data)
    with pytest.raises(SpecError) as e:
        load_spec(path)
    msg = str(e.value)
    assert isinstance(e.value, UserError)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: "), msg
    assert field in msg and detail in msg, msg
    if field[0].isalpha() and "YAML" not in field and "key" not in field:
        assert msg.startswith(f"{path}: {field}"), msg


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(SpecError, match=r"^nope\.yaml: file not found$"):
        load_spec("nope.yaml")
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)


def test_file_name_is_reported_as_given(root, monkeypatch):
    write(root, mutate(lambda d: d.update(accounting="bytes")))
    monkeypatch.chdir(root)
    with pytest.raises(SpecError, match=r"^mix\.yaml: accounting: unknown accounting 'bytes'"):
        load_spec("mix.yaml")


def test_cli_reports_a_bad_spec_in_one_line(root):
    path = write(root, mutate(lambda d: seg(0)(d)["weights"].update(text=-1)))
    proc = subprocess.run([sys.executable, "-m", "omniscale", "data", "inspect", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"{path}: schedule.segments[0].weights.text: must be >= 0, got -1" in proc.stderr
