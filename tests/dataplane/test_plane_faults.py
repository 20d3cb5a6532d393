"""The plane as separate processes: ``kill -9`` mid-epoch, restart (with the same or fewer
ranks), and every sample of the epoch is still trained exactly once; bad requests are refused
with one line each while the plane keeps serving.

Real processes throughout: ``omniscale plane serve`` and four ``plane_trainer.py`` ranks. The
test synchronises only by blocking on their output (the plane's "serving" line, a rank's
"committed STEP" lines), never by sleeping. The epoch is a small spec whose sources all
``stop`` when spent, so the mixture ends after one pass: 256 samples, 32 steps of 8.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from omniscale.dataplane.client import PlaneClient, PlaneError
from omniscale.index_schema import read_index
from tests.dataplane.plane_steps import commit_step
from tests.demo_data import copy_demo
from tests.procs import Proc as _Proc
from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("plane_trainer.py")
SOURCES = ("image_caption", "video_caption", "audio_caption")
SERVE = ["--window", "4", "--snapshot-every", "3", "--global-batch-samples", "8",
         "--micro-batch-tokens", "2048", "--sp-max", "2"]
TIMEOUT = 60  # seconds any one wait may take before the test fails (never a pacing delay)


@pytest.fixture(scope="module")
def epoch(demo_root, tmp_path_factory) -> Path:
    """A tiny demo and ``epoch.yaml``: three of its sources at equal weight in samples, each
    stopping when spent, so the mixture is exhausted after exactly one epoch."""
    demo = copy_demo(demo_root, tmp_path_factory.mktemp("faults") / "demo")
    media = yaml.safe_load((demo / "mix.yaml").read_text())["media"]
    spec = {"seed": 7, "tokenizer": "tokenizer.json", "accounting": "samples",
            "on_exhausted": "stop", "media": media,
            "sources": [{"name": n, "path": f"train/{n}", "format": "webdataset",
                         "template": n, "weight": 1} for n in SOURCES]}
    (demo / "epoch.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return demo / "epoch.yaml"


def Proc(args: list[str]) -> _Proc:
    return _Proc(args, timeout=TIMEOUT)


def serve(spec: Path, state: Path, dp: int, port: int, *extra: str) -> tuple[Proc, str, int]:
    """Start ``omniscale plane serve``; returns it, its URL and the step it starts at."""
    plane = Proc([sys.executable, "-m", "omniscale", "plane", "serve", "--spec", str(spec),
                  "--state-dir", str(state), "--dp", str(dp), "--port", str(port), *SERVE,
                  *extra])
    match = plane.wait_for(r"serving (\S+) \(step (\d+), (\d+) ranks")
    assert int(match[3]) == dp
    return plane, match[1], int(match[2])


def job_paths(tmp_path: Path) -> tuple[Path, int, list[Path]]:
    """A 4-rank job's plane state dir, a free port, and each rank's record file."""
    return tmp_path / "state", free_port(), [tmp_path / f"rank{r}.jsonl" for r in range(4)]


def trainer(url: str, rank: int, record: Path, *pause: int) -> Proc:
    return Proc([sys.executable, str(TRAINER), url, str(rank), str(record), *map(str, pause)])


def expected_epoch(spec: Path) -> tuple[Counter, Counter]:
    """Every sample of the spec's sources once, and each sample's encoder item count."""
    samples, items = Counter(), Counter()
    for name in SOURCES:
        table = read_index(spec.parent / "train" / name).to_pylist()
        for row in table:
            assert row["error"] is None
            samples[(name, row["shard"], row["key"])] = 1
            items[(name, row["shard"], row["key"])] = (
                len(row["image_patches"]) + len(row["video_patches"]) + len(row["audio_frames"]))
    return samples, items


def trained(records: list[Path], steps: int, dp_from: dict[int, int]) -> tuple[Counter, Counter]:
    """From the ranks' records: how often each sample was trained and each encoder item
    encoded, counting for every step the plans it was committed with. A (step, rank) fetched
    twice (across a crash, or re-planned after a resize) counts once, as its last fetch."""
    last: dict[tuple[int, int], dict] = {}
    for path in records:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            last[(record["step"], record["rank"])] = record
    samples, items = Counter(), Counter()
    for step in range(steps):
        dp = [d for s, d in sorted(dp_from.items()) if s <= step][-1]
        for rank in range(dp):
            record = last[(step, rank)]
            assert record["dp"] == dp, (step, rank, record["dp"])
            for source, shard, key, role, sp_index, kind, index in record["rows"]:
                if role == "llm" and sp_index == 0:
                    samples[(source, shard, key)] += 1
                elif role == "encode":
                    items[(source, shard, key, kind, index)] += 1
    return samples, items


def audit(state: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "omniscale", "plane", "audit", str(state),
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def logged_commits(lines: list[bytes]) -> set[int]:
    """The steps a log's complete lines record as committed by every rank (a line the kill
    tore does not parse and is skipped, as the plane's restart cuts it off)."""
    steps = set()
    for line in lines:
        try:
            record = json.loads(line)["r"]
        except (ValueError, KeyError, TypeError):
            continue
        if record.get("t") == "commit":
            steps.add(record["step"])
    return steps


def first_missing(steps: set[int]) -> int:
    return next(s for s in range(len(steps) + 1) if s not in steps)


@pytest.mark.slow
@pytest.mark.parametrize("dp_after", [4, 3], ids=["restart", "restart-with-3-ranks"])
def test_kill_9_mid_epoch_loses_and_repeats_nothing(epoch, tmp_path, dp_after):
    state, port, records = job_paths(tmp_path)
    procs: list[Proc] = []
    try:
        plane, url, _ = serve(epoch, state, 4, port)
        procs += [plane]
        # Ranks 0-2 stop holding steps 6, 7 and 8 trained but not committed: steps 0-5 are
        # trained, 6-7 partly (some ranks' commits logged, not all), 8 on; rank 3 runs on
        # (up to the planning horizon) and is in flight when the plane dies.
        ranks = [trainer(url, r, records[r], 6 + r) for r in range(3)]
        ranks.append(trainer(url, 3, records[3]))
        procs += ranks
        for r in range(3):
            ranks[r].wait_for(rf"^paused {6 + r}$")
        ranks[3].wait_for(r"^committed 7$")  # it may lag (a loaded machine): steps 0-5 done
        plane.kill()  # kill -9
        if dp_after == 3:
            ranks[3].kill()  # the job comes back one rank short
        plane, url_again, resumed = serve(epoch, state, dp_after, port)
        procs += [plane]
        assert url_again == url and resumed == 6, "".join(plane.output)
        for rank in ranks[:3]:
            rank.resume()  # commits the plan it holds; after a resize it is refused
        for rank in ranks[:dp_after]:
            rank.finish()  # each ran until "the mixture is exhausted"
        with PlaneClient(url, retry_for=5) as client:
            status = client.status()
        assert status["next_step"] == status["exhausted_at"] == 32
    finally:
        for proc in procs:
            proc.kill()

    assert_epoch_trained_once(epoch, state, records, {0: 4, 6: dp_after})


def assert_epoch_trained_once(epoch: Path, state: Path, records: list[Path],
                              dp_from: dict[int, int]) -> None:
    """The audit is clean and calls every epoch complete, it counts every sample of the epoch
    committed, and the ranks' own records trained each sample and item exactly once."""
    report = audit(state)
    assert (report["duplicated"], report["missing"], report["fingerprint_mismatches"]) == \
        (0, 0, []), report
    assert all(row["complete"] for row in report["rows"]), report["rows"]
    want_samples, want_items = expected_epoch(epoch)
    per_source = Counter()
    for source, _, _ in want_samples:
        per_source[source] += 1
    assert {r["source"]: r["committed"] for r in report["rows"] if r["epoch"] == 0} == \
        dict(per_source) and report["next_step"] == 32
    samples, items = trained(records, 32, dp_from)
    assert samples == want_samples  # every sample of the epoch, each exactly once
    assert set(items.values()) == {1} and sum(items.values()) == sum(want_items.values())


def test_bad_requests_are_refused_in_one_line_and_the_plane_keeps_serving(epoch, tmp_path):
    plane, url, _ = serve(epoch, tmp_path / "state", 4, free_port(), "--token", "s3cret")
    try:
        client = PlaneClient(url, token="s3cret", retry_for=5)
        commit_step(client, 0)  # the whole step at once
        bad = epoch.parent / "bad.yaml"  # under the spec root: the starting spec's dir
        bad.write_text(epoch.read_text().replace("weight: 1", "weight: -1", 1))
        outside = tmp_path / "outside.yaml"
        outside.write_text(epoch.read_text())
        cases = [
            (lambda: client.get_plan(1, 9), "rank 9: step 1 is planned for 4 ranks (0..3)"),
            (lambda: client.get_plan(0, 0), "step 0 is already committed"),
            (lambda: client.commit(0, 2), "step 0 is already committed"),
            (lambda: client.get_plan(500, 0), "step 500 is too far ahead"),
            (lambda: PlaneClient(url, retry_for=5).status(), "missing or wrong token"),
            (lambda: PlaneClient(url, token="wrong", retry_for=5).get_plan(1, 0),
             "missing or wrong token"),
            (lambda: client.reload(str(bad)), "bad.yaml: sources[0].weight: invalid"),
            (lambda: client.reload(str(epoch.parent / "nope.yaml")), "nope.yaml"),
            (lambda: client.reload(str(outside)), "reload reads specs only under"),
        ]
        for call, message in cases:
            with pytest.raises(PlaneError) as refused:
                call()
            text = str(refused.value)
            assert message in text and "\n" not in text, text
            assert text.startswith(f"plane at {url}: "), text
        assert client.get_plan(1, 3).num_rows > 0 and plane.popen.poll() is None
        assert commit_step(client, 1)["next_step"] == 2
    finally:
        plane.kill()


@pytest.mark.slow
def test_kill_9_at_random_points_with_torn_writes_over_restart_cycles(epoch, tmp_path):
    """Three cycles of: ranks training freely, ``kill -9`` of the plane at a random step,
    half a log record left behind (the write the kill tore), restart on the same port. The
    epoch still trains every sample exactly once and the audit calls it complete."""
    import random

    rng = random.Random(14)
    state, port, records = job_paths(tmp_path)
    procs: list[Proc] = []
    try:
        plane, url, _ = serve(epoch, state, 4, port)
        procs += [plane]
        ranks = [trainer(url, r, records[r]) for r in range(4)]
        procs += ranks
        at = 0
        for cycle in range(3):
            at += rng.randint(2, 7)
            ranks[rng.randrange(4)].wait_for(rf"^committed {at}$")
            plane.kill()  # kill -9, wherever the plane is
            wal = state / "wal.jsonl"
            lines = wal.read_bytes().split(b"\n")
            logged = logged_commits(lines)
            torn = lines[rng.randrange(1, len(lines) - 1)]
            with open(wal, "ab") as f:
                f.write(torn[:rng.randrange(1, len(torn))])
            plane, url_again, resumed = serve(epoch, state, 4, port)
            procs += [plane]
            # The ranks run on while the test waits and kills, so the plane may have committed
            # past ``at``: it must resume exactly after the last step its log holds committed.
            assert url_again == url and resumed == first_missing(logged), "".join(plane.output)
            assert (state / f"wal.torn-{cycle}.bin").exists()
        for rank in ranks:
            rank.finish()
        with PlaneClient(url, retry_for=5) as client:
            assert client.status()["next_step"] == 32
    finally:
        for proc in procs:
            proc.kill()
    assert_epoch_trained_once(epoch, state, records, {0: 4})
