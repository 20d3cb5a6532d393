"""A rank's plane session (``tools.train.plane_session``): its commits -- in the background, in
order, queued ones together, a refused one raised and never lost -- the reports a launcher
lists, and that no loader talks to the plane but through the plan source it is given."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from omniscale.dataplane.client import PlaneClient, PlaneError
from omniscale.dataplane.embedded import start_embedded
from omniscale.loaders.pipeline import RankLoader
from omniscale.tools.train.plane_session import REPORTS_FILE, PlaneSession, loader_for
from tests.loaders.pipeline_fixtures import CONFIG, loader_args, spec_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def spec(demo):
    return spec_of(demo / "mix.yaml")


def _loader(url: str, rank: int, spec):
    return loader_for(url, rank, RankLoader, **loader_args(spec), num_workers=0)


@pytest.mark.timeout(60)
def test_commits_queued_behind_one_in_flight_go_together(spec, tmp_path):
    """While a commit is in flight, the trainer's next commits queue and go in one request
    (``commit_many``), in step order; each future gets its step's reply. The plane's reply to
    the first is held (events, not durations), so the queue is exact."""
    with start_embedded(spec.path, tmp_path, CONFIG) as plane, PlaneClient(plane.url) as c:
        loader, other = _loader(plane.url, 0, spec), _loader(plane.url, 1, spec)
        control = loader.session._control
        sent, held, release = [], threading.Event(), threading.Event()
        single, many = control.commit, control.commit_many

        def commit(step, rank, plan_fp=None):
            sent.append([step])
            held.set()
            assert release.wait(30)
            return single(step, rank, plan_fp=plan_fp)

        def commit_many(steps, rank, plan_fps):
            sent.append(list(steps))
            return many(rank=rank, steps=steps, plan_fps=plan_fps)
        control.commit, control.commit_many = commit, commit_many
        with loader, other:
            futures = []
            for step in range(4):
                for ld in (other, loader):
                    assert next(ld).step == step
                futures.append(loader.commit(step))
                if step == 0:
                    assert held.wait(30)  # step 0 is in flight; 1..3 queue behind it
                other.commit(step)
            other.wait_commits()
            release.set()
            loader.wait_commits()
            assert sent == [[0], [1, 2, 3]]
            assert [f.result()["committed"] for f in futures] == [True] * 4
            assert futures[-1].result()["next_step"] == 4
            assert c.status()["next_step"] == 4


@pytest.mark.timeout(60)
def test_commits_go_in_the_background_and_a_refused_one_is_raised(spec, tmp_path):
    """``commit`` returns before the plane answers; commits arrive in step order; a refused
    one is raised by the next ``commit``, by ``wait_commits`` and by ``close`` -- not lost."""
    with start_embedded(spec.path, tmp_path, CONFIG) as plane, PlaneClient(plane.url) as c:
        loader, other = _loader(plane.url, 0, spec), _loader(plane.url, 1, spec)
        with loader, other:
            for step in range(3):
                for ld in (loader, other):
                    assert next(ld).step == step
                    ld.commit(step)
            loader.wait_commits(), other.wait_commits()
            assert c.status()["next_step"] == 3  # every commit, in order
            refused = loader.commit(10_000)  # far past anything planned
            assert isinstance(refused.exception(), PlaneError)  # waits for the answer
            with pytest.raises(PlaneError, match="10000"):
                loader.commit(3)  # the refusal surfaces here, before this one is sent
            assert next(loader).step == 3
            loader.commit(10_001)
            with pytest.raises(PlaneError, match="10001"):
                loader.wait_commits()
            loader.commit(10_002)
            with pytest.raises(PlaneError, match="10002"):
                loader.close()
        assert c.status()["next_step"] == 3  # step 3 was never committed by rank 1


@pytest.mark.timeout(60)
def test_a_commit_carries_the_fingerprint_of_the_plan_trained(spec, tmp_path):
    """The trainer commits with its batch's plan fingerprint: a wrong one is refused."""
    with start_embedded(spec.path, tmp_path, CONFIG) as plane, \
            PlaneSession(plane.url, 0) as session:
        loader = RankLoader(session.plans(0, 2), session.report, 0, **loader_args(spec),
                            num_workers=0)
        with loader:
            batch = next(loader)
            refused = session.commit(batch.step, "0" * len(batch.plan_fp))
            assert isinstance(refused.exception(), PlaneError)
            with pytest.raises(PlaneError):
                session.wait_commits()
            assert session.commit(batch.step, batch.plan_fp).result()["step"] == 0


@pytest.mark.timeout(60)
def test_the_reports_a_launcher_lists_come_from_the_plane(spec, tmp_path):
    """``write_reports``: every suspect (and corrupt) report of the plane's log, asked of the
    plane (the ``reports`` action), written for the launcher; a kind the log does not report
    is refused in one line."""
    with start_embedded(spec.path, tmp_path / "plane", CONFIG) as plane, \
            PlaneSession(plane.url, 0) as session:
        ref = plane.plane.get_plan(0, 0).to_pylist()[0]
        sample = {k: ref[k] for k in ("source", "shard", "key")} | {"epoch": ref["epoch"]}
        plane.plane.get_plan(0, 1)
        session.report_suspect(0, [sample], "spike")
        path = session.write_reports(tmp_path)
        with pytest.raises(PlaneError, match="reports: kind must be one of") as refused:
            session._control.reports("commit")
        assert "\n" not in str(refused.value)
    assert path == tmp_path / REPORTS_FILE
    found = json.loads(path.read_text())
    assert found["corrupt"] == []
    suspect, = found["suspect"]
    assert (suspect["t"], suspect["step"], suspect["reason"]) == ("suspect", 0, "spike")
    assert suspect["samples"] == [sample]


def test_no_loader_connects_to_the_plane_but_the_plan_source():
    """A loader is handed a plan source and a reporter: ``loaders/`` imports no client except
    in ``prefetch.py``, the plan source itself."""
    found = []
    for path in sorted((ROOT / "loaders").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if re.search(r"dataplane\.(local|client) import .*\b(connect|PlaneClient)\b", text):
            found.append(path.name)
    assert found == ["prefetch.py"]
