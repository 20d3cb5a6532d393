"""``omniscale train`` on data with corrupt samples the index does not know about (issue #9).

A copy of the indexed tiny demo has two image members of ``image_caption`` (about 1% of the
demo's 463 training samples; 2 of the source's 128) overwritten in place, keeping each tar's
size and mtime so the index still lists them as good: only decoding finds out. A spec weighted
to ``image_caption`` goes through more than one epoch of it in ten small steps, so both are
hit.

* ``data.policy=skip``: the run finishes; the metrics rows count the skips; the trainer names
  them (one line, and ``corrupt`` in ``result.json``); the plane quarantined them and reports
  them in its status (after a restart from its state dir too); the audit finds no sample lost
  or repeated, the corrupt ones being neither trained nor counted missing.
* ``data.policy=fail``: the run stops with one line naming the sample, exit status 2.

Each on one process and on two (FSDP; a rank 1 reports to rank 0's embedded plane).
"""

from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
import yaml

from omniscale.dataplane.audit import audit_state_dir
from omniscale.tools.cli import main
from omniscale.tools.train.metrics import read_metrics

STEPS = 10
BAD_ROWS = (37, 101)  # rows of image_caption's index (one .png, one .jpg member)


@pytest.fixture(scope="module")
def damaged(demo, tmp_path_factory):
    """A copy of the session's demo (copy2 keeps mtimes: its index stays current) with two
    image members overwritten, and a spec weighted to their source."""
    root = shutil.copytree(demo, tmp_path_factory.mktemp("corrupt") / "demo")
    source = root / "train" / "image_caption"
    rows = pq.read_table(source / "_index.parquet").to_pylist()
    bad = []
    for i in BAD_ROWS:
        row = rows[i]
        member, = [m for m in row["members"] if m["name"].endswith((".jpg", ".png"))]
        tar = source / row["shard"]
        stat = tar.stat()
        with open(tar, "r+b") as f:  # the member's bytes only: headers and size unchanged
            f.seek(member["offset"])
            f.write(b"\0" * member["size"])
        os.utime(tar, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the index stays current
        bad.append((row["shard"], row["key"], member["name"]))
    spec = yaml.safe_load((root / "mix.yaml").read_text())
    spec["sources"] = [s for s in spec["sources"] if s["name"] in ("image_caption", "text")]
    spec["schedule"] = {"unit": "steps", "segments": [
        {"kind": "const", "start": 0, "end": None, "weights": {"image_caption": 4, "text": 1}}]}
    (root / "images.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return root, bad


def _args(root, out, policy, nproc) -> list[str]:
    sets = {"data.spec": root / "images.yaml", "data.eval_spec": "null", "data.workers": 0,
            "data.global_batch_tokens": 2048, "data.micro_batch_tokens": 2048,
            "data.policy": policy, "optim.warmup_steps": 1, "eval.enabled": False,
            "steps": STEPS, "checkpoint_every": 5, "output_dir": out}
    return ["train", "configs/demo_omni.yaml", "--no-progress", "--nproc", str(nproc),
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]


@pytest.mark.parametrize("nproc", [1, 2])
def test_skip_policy_finishes_reports_and_loses_nothing(damaged, tmp_path, capsys, nproc):
    root, bad = damaged
    out = tmp_path / "run"
    assert main(_args(root, out, "skip", nproc)) == 0
    printed = capsys.readouterr().out
    bad_keys = {key for _, key, _ in bad}

    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(len(r["rank_compute_s"]) == nproc for r in rows)
    # The trainer says so: one line, and the list in result.json. A key can be skipped again
    # in a later epoch drawn (plans run ahead) before its report.
    result = json.loads((out / "result.json").read_text())["corrupt"]
    skipped = result["skipped"]
    assert skipped >= len(bad) and result["distinct"] == len(bad)
    assert len(result["samples"]) == skipped
    assert len({(s["step"], s["key"]) for s in result["samples"]}) == skipped
    assert {(s["shard"], s["key"]) for s in result["samples"]} == {(s, k) for s, k, _ in bad}
    assert all(s["step"] < STEPS and "not an image" in s["reason"] for s in result["samples"])
    line, = [ln for ln in printed.splitlines() if "corrupt sample(s) skipped" in ln]
    first = result["samples"][0]
    assert line.startswith(f"omniscale train: {skipped} corrupt sample(s) skipped and replaced")
    assert f"first: step {first['step']}: image_caption/{first['key']} ({first['shard']}): " \
           f"member '" in line

    # Nothing lost or repeated; the corrupt samples were never trained.
    report = audit_state_dir(out / "plane")
    assert report["duplicated"] == 0 and report["missing"] == 0, report
    assert report["fingerprint_mismatches"] == [] and report["next_step"] == STEPS
    trained = sum(sum(r["mix_samples"].values()) for r in rows)
    assert sum(r["committed"] for r in report["rows"]) == trained > 0
    epoch0, = [r for r in report["rows"] if (r["source"], r["epoch"]) == ("image_caption", 0)]
    assert any(r["source"] == "image_caption" and r["epoch"] > 0 for r in report["rows"])
    assert epoch0["committed"] == 128 - len(bad) and epoch0["missing"] == 0  # a finished epoch

    # The plane's status, after a restart from (a copy of) its state dir.
    from omniscale.dataplane.client import PlaneClient
    from omniscale.dataplane.embedded import start_embedded
    from omniscale.dataplane.journal import Journal
    from omniscale.dataplane.plane import PlaneConfig

    state = tmp_path / "plane-copy"
    shutil.copytree(out / "plane", state)
    config = PlaneConfig(**Journal(state).load_snapshot(0)["config"])
    with start_embedded(root / "images.yaml", state, config) as plane, \
            PlaneClient(plane.url) as client:
        status = client.status()
    assert status["next_step"] == STEPS
    source, = [s for s in status["sources"] if s["source"] == "image_caption"]
    assert source["corrupt_reported"] >= skipped and source["quarantined"] == len(bad)
    assert {r["key"] for r in status["corrupt_recent"]} == bad_keys

    # once per sample, however many ranks decoded it (its LLM rank, its encoding rank)
    assert sum(r["skipped"] for r in rows) == skipped


@pytest.mark.parametrize("nproc", [1, 2])
def test_fail_policy_stops_with_one_line_naming_the_sample(damaged, tmp_path, capsys,
                                                           nproc):
    root, bad = damaged
    rc = main(_args(root, tmp_path / "run", "fail", nproc))
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    names = [f"omniscale: error: image_caption/{key}: member '{member}': not an image"
             for _, key, member in bad]
    assert "\n" not in err and any(err.startswith(n) for n in names), err
