"""``DataPlane.status()``, its rendering (``tools.plane_status``) and ``omniscale plane status``
against a real tiny demo plane."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from omniscale.dataplane import wire
from omniscale.dataplane.client import PlaneClient
from omniscale.dataplane.embedded import start_embedded
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.dataplane.status import CLIENT_WINDOW_S, plane_status
from omniscale.tools.plane_status import print_status
from tests.dataplane.plane_steps import commit_step

ROOT = Path(__file__).resolve().parents[2]
CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=2, snapshot_every=4)
SOURCES = ("text", "docs", "image_caption", "video_caption", "audio_caption", "interleaved")



@pytest.fixture(scope="module")
def trained(demo, tmp_path_factory):
    """A plane after steps 0..5 trained by two ranks, with rank 0 already on step 6."""
    plane = DataPlane(demo / "mix.yaml", tmp_path_factory.mktemp("state"), CONFIG)
    for step in range(6):
        for rank in range(2):
            plane.get_plan(step, rank)
        commit_step(plane, step)
    plane.get_plan(6, 0)
    return plane


def test_status_reports_progress_mixture_balance_and_clients(trained):
    s = trained.status()
    assert wire.decode(wire.encode(s)) == s  # it crosses the wire as it is
    assert (s["next_step"], s["dp"], s["served_max_step"]) == (6, 2, 6)
    assert s["plans_ahead"] == s["planned_through"] - 6 > 0
    assert s["snapshot"]["last_step"] == 4 and s["snapshot"]["every"] == 4
    assert s["exhausted_at"] is None and s["exhausted"] == [] and s["dropped"] == []

    assert [c["rank"] for c in s["clients"]] == [0, 1]
    assert [c["last_step"] for c in s["clients"]] == [6, 5]
    later = plane_status(trained, time.monotonic() + CLIENT_WINDOW_S + 1)
    assert later["clients"] == []  # silent for over a minute: no longer connected

    mixture = {m["source"]: m for m in s["mixture"]}
    assert set(mixture) == set(SOURCES)
    assert sum(m["realized_share"] for m in mixture.values()) == pytest.approx(1.0)
    assert sum(m["weight"] for m in mixture.values()) == pytest.approx(1.0)
    for m in mixture.values():
        assert m["deviation"] == pytest.approx(m["realized_share"] - m["target_share"])
        assert abs(m["deviation"]) < 0.05
    sources = {r["source"]: r for r in s["sources"]}
    assert set(sources) == set(SOURCES)
    for name in ("text", "docs", "image_caption"):  # weighted at the start of the schedule
        assert sources[name]["served_samples"] > 0 and sources[name]["served_tokens"] > 0
        assert sources[name]["served_tokens"] == mixture[name]["realized"]

    steps = {r["step"]: r for r in s["recent_steps"]}
    assert steps[5]["committed"] and not steps[6]["committed"]
    assert max(steps) == s["planned_through"]
    for r in steps.values():
        assert r["max_cost"] >= r["lower_bound"] - 1e-6 and r["imbalance"] >= 1.0
    assert len(s["next_step_rank_cost"]) == 2
    assert max(s["next_step_rank_cost"]) == pytest.approx(steps[6]["max_cost"])


def test_print_status_names_every_source(trained):
    out = io.StringIO()
    print_status(trained.status(), Console(file=out, width=200))
    text = out.getvalue()
    for name in SOURCES:
        assert name in text
    for heading in ("next step 6, dp 2", "target share", "served tokens", "imbalance",
                    "rank 0 at step 6", "snapshot at step 4"):
        assert heading in text


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omniscale", "plane", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_status_command_against_an_embedded_plane(demo, tmp_path):
    with start_embedded(demo / "mix.yaml", tmp_path, CONFIG) as plane, \
            PlaneClient(plane.url) as client:
        for step in range(3):
            for rank in range(2):
                client.get_plan(step, rank)
            commit_step(client, step)
        shown = cli("status", plane.url)
        as_json = cli("status", plane.url, "--json")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"plane {demo / 'mix.yaml'}: next step 3, dp 2")
    for name in SOURCES:
        assert name in shown.stdout
    # Piped output is not wrapped at 80 columns: whole rows stay on one line.
    assert any("on exhaustion: next_epoch" in line for line in lines)
    assert max(map(len, lines)) > 80
    assert as_json.returncode == 0, as_json.stderr
    status = json.loads(as_json.stdout)
    assert status["next_step"] == 3 and {c["rank"] for c in status["clients"]} == {0, 1}
