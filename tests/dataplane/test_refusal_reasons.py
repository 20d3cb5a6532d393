"""Every refusal's Reason crosses the real wire -- a DataPlane behind a PlaneServer on loopback,
a PlaneClient -- over each way a plan travels (the ``plan`` action, the plan lane, the Flight
exchange stream), and the one line the user sees is the plane's own message, unchanged.

Code branches on ``PlaneError.reason`` (loaders/prefetch.py, tests/dataplane/plane_trainer.py),
never on the message's words; the messages below are pinned because tests and users read them.
"""

from __future__ import annotations

import os
import pickle

import pyarrow.flight as flight
import pytest
import yaml

from omniscale.dataplane.actions import Reason, RequestError
from omniscale.dataplane.client import PlaneClient, PlaneError
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.dataplane.server import PlaneServer
from tests.dataplane.plane_steps import commit_step

CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=2)
TOKEN = "s3cret"
# how a plan travels: (the server opens its plan lane, the client keeps a connection)
TRANSPORTS = {"action": (True, False), "lane": (True, True), "exchange": (False, True)}
PLAN_REFUSALS = [  # (step, rank, reason, message) with steps 0 and 1 committed
    (2, 5, Reason.UNKNOWN_RANK, "rank 5: step 2 is planned for 2 ranks (0..1)"),
    (1, 0, Reason.COMMITTED, "step 1 is already committed (the next step to train is 2)"),
    (500, 0, Reason.TOO_FAR_AHEAD,
     "step 500 is too far ahead: plans reach step 11 while step 2 is not committed"),
    (-1, 0, Reason.INVALID, "step -1 is negative"),
]
COMMIT_REFUSALS = [  # (args of commit, reason, message) with steps 0 and 1 committed
    ((2, 0), Reason.NOT_SERVED,
     "step 2 was never served to rank 0: fetch its plan first (or send its plan_fp)"),
    ((2,), Reason.INVALID, "step 2: a whole-step commit needs plan_fp, the step fingerprint "
                           "of every rank's plan (plan_table.step_fingerprint)"),
    ((2, None, "0" * 16), Reason.REPLANNED,
     "step 2: plan_fp does not match the step's plans on 2 ranks: fetch them again"),
    ((2, 0, "0" * 16), Reason.REPLANNED,
     "step 2 was re-planned for 2 ranks since rank 0 fetched it: fetch it again"),
    ((2, 5), Reason.UNKNOWN_RANK, "rank 5: step 2 has 2 ranks (0..1)"),
    ((0, 0), Reason.COMMITTED, "step 0 is already committed (the next step to train is 2)"),
]


def serve(plane, lane: bool = True, server_class=PlaneServer) -> PlaneServer:
    return server_class(plane, token=TOKEN, lane=lane).start()


def plane_at_step_2(demo, state_dir) -> DataPlane:
    plane = DataPlane(demo / "mix.yaml", state_dir, CONFIG)
    for step in range(2):
        commit_step(plane, step)
    return plane


@pytest.fixture()
def served(demo, tmp_path):
    """(plane, server, client): steps 0 and 1 committed, the client on the ``plan`` action."""
    plane = plane_at_step_2(demo, tmp_path / "state")
    server = serve(plane)
    client = PlaneClient(server.url, token=TOKEN, retry_for=5)
    yield plane, server, client
    client.close()
    server.stop()


def refused(call, error=PlaneError):
    with pytest.raises(error) as info:
        call()
    return info.value


def same_refusal(server, what, remote, direct, reason, message=None):
    """The client's refusal carries ``reason`` and, after its one prefix, the plane's message;
    the plane itself (called in process) raises the same reason and message."""
    here = refused(direct, RequestError)
    there = refused(remote)
    assert here.reason == there.reason == reason
    assert str(there) == f"plane at {server.url}: {what}: {here}"
    if message is not None:
        assert str(here) == message
    assert "\n" not in str(there)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_plan_refusals_carry_their_reason_on_every_transport(demo, tmp_path, transport):
    lane, stream = TRANSPORTS[transport]
    plane = plane_at_step_2(demo, tmp_path / "state")
    server = serve(plane, lane)
    client = PlaneClient(server.url, token=TOKEN, retry_for=5, stream=stream)
    try:
        for step, rank, reason, message in PLAN_REFUSALS:
            same_refusal(server, f"get_plan(step={step}, rank={rank})",
                         lambda: client.get_plan(step, rank),
                         lambda: plane.get_plan(step, rank), reason, message)
        assert client.get_plan(2, 1).num_rows  # the connection still serves
        if stream:  # the refusals really came over the lane / the exchange stream
            assert (client._lane_port != 0) == lane
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_end_of_the_mixture_is_exhausted_on_every_transport(demo, tmp_path, transport):
    spec = yaml.safe_load((demo / "mix.yaml").read_text())
    spec.pop("schedule")
    spec.update(accounting="samples", on_exhausted="stop",
                sources=[{**s, "weight": 1} for s in spec["sources"] if s["name"] == "text"])
    (demo / "text_once.yaml").write_text(yaml.safe_dump(spec))
    config = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_samples=8,
                         sp_max=2)
    plane = DataPlane(demo / "text_once.yaml", tmp_path / "state", config)
    lane, stream = TRANSPORTS[transport]
    server = serve(plane, lane)
    client = PlaneClient(server.url, token=TOKEN, retry_for=5, stream=stream)
    try:
        step = 0
        while plane.exhausted_at is None or step < plane.exhausted_at:
            commit_step(client, step, dp=2)
            step += 1
        last = step - 1
        same_refusal(server, f"get_plan(step={step}, rank=0)", lambda: client.get_plan(step, 0),
                     lambda: plane.get_plan(step, 0), Reason.EXHAUSTED,
                     f"step {step}: the mixture is exhausted (the last step is {last})")
        same_refusal(server, "commit", lambda: client.commit(step, 0, plan_fp="0" * 16),
                     lambda: plane.commit(step, 0, plan_fp="0" * 16), Reason.EXHAUSTED,
                     f"step {step} was never planned (the mixture is exhausted after step "
                     f"{last})")
        same_refusal(server, "report_corrupt",
                     lambda: client.report_corrupt(step, 0, "text", "s.tar", "k", "bad"),
                     lambda: plane.report_corrupt(step, 0, "text", "s.tar", "k", "bad"),
                     Reason.EXHAUSTED, f"step {step} was never planned")
    finally:
        client.close()
        server.stop()


def test_commit_refusals_carry_their_reason(served):
    plane, server, client = served
    for args, reason, message in COMMIT_REFUSALS:
        same_refusal(server, "commit", lambda: client.commit(*args),
                     lambda: plane.commit(*args), reason, message)
    client.get_plan(2, 0)
    client.commit(2, 0)
    same_refusal(server, "commit", lambda: client.commit(2, 0), lambda: plane.commit(2, 0),
                 Reason.RANK_COMMITTED, "rank 0 already committed step 2")
    assert plane.next_step == 2 and plane.rank_commits[2] == {0}


def test_other_refusals_carry_their_reason(served, demo):
    plane, server, client = served
    root = os.path.realpath(demo)
    cases = [
        ("snapshot", (7,), Reason.INVALID,
         "step 7: only the next step to train (2) can be snapshotted"),
        ("set_costs", (-1.0, 0.0), Reason.INVALID,
         "costs: linear and quadratic must be finite, in [0, 1e+12] and not both 0, got -1.0, "
         "0.0"),
        ("reload", ("nope.yaml",), Reason.SPEC, f"{root}/nope.yaml: file not found"),
        ("reload", ("../elsewhere.yaml",), Reason.SPEC,
         f"../elsewhere.yaml: reload reads specs only under {root} (the plane's --spec-root)"),
        ("reload", ("eval.yaml",), Reason.SPEC,
         f"{root}/eval.yaml: accounting cannot change during a run (tokens -> samples)"),
        ("report_corrupt", (2, 0, "text", "s.tar", "k", "bad"), Reason.UNKNOWN_SAMPLE,
         "text/k (s.tar, epoch 0) is not in rank 0's plan of step 2"),
    ]
    for name, args, reason, message in cases:
        what = {"set_costs": "costs"}.get(name, name)
        same_refusal(server, what, lambda: getattr(client, name)(*args),
                     lambda: getattr(plane, name)(*args), reason, message)


def test_a_change_that_does_not_plan_is_unplannable(served, demo):
    plane, server, client = served
    spec = yaml.safe_load((demo / "mix.yaml").read_text())
    (demo / "train" / "unindexed").mkdir(exist_ok=True)
    spec["sources"].append({**spec["sources"][0], "name": "unindexed", "path": "train/unindexed"})
    (demo / "unindexed.yaml").write_text(yaml.safe_dump(spec))
    same_refusal(server, "reload", lambda: client.reload("unindexed.yaml"),
                 lambda: plane.reload("unindexed.yaml"), Reason.UNPLANNABLE)
    assert "unindexed.yaml: refused, window 1 does not plan with it" in str(
        refused(lambda: client.reload("unindexed.yaml")))


def test_a_malformed_request_is_refused_without_a_finer_reason(served):
    _, server, client = served
    error = refused(lambda: client.reload(""))  # the server's own check, before the plane
    assert error.reason == Reason.REFUSED
    assert str(error) == f"plane at {server.url}: reload: reload: 'spec' (a path) is required"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_bug_in_the_plane_is_internal_on_every_transport(demo, tmp_path, transport,
                                                           monkeypatch):
    plane = plane_at_step_2(demo, tmp_path / "state")

    def boom(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(plane, "get_plan", boom)
    lane, stream = TRANSPORTS[transport]
    server = serve(plane, lane)
    client = PlaneClient(server.url, token=TOKEN, retry_for=5, stream=stream)
    try:
        error = refused(lambda: client.get_plan(2, 0))
        assert error.reason == Reason.INTERNAL
        assert str(error).endswith("get_plan(step=2, rank=0): internal error: RuntimeError: boom")
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_wrong_token_is_unauthenticated(served, stream):
    _, server, _ = served
    with PlaneClient(server.url, token="wrong", retry_for=5, stream=stream) as client:
        error = refused(lambda: client.get_plan(2, 0))
    assert error.reason == Reason.UNAUTHENTICATED
    assert str(error).endswith("missing or wrong token")


def test_a_plane_that_stays_away_is_unreachable(demo, tmp_path):
    server = serve(plane_at_step_2(demo, tmp_path / "state"))
    url = server.url
    server.stop()
    error = refused(lambda: PlaneClient(url, token=TOKEN, retry_for=0.3).status())
    assert error.reason == Reason.UNREACHABLE
    assert str(error).startswith(f"plane at {url}: status failed for 0.3 s: ")


def test_every_reason_is_exercised():
    tested = {r for *_, r, _ in PLAN_REFUSALS} | {r for _, r, _ in COMMIT_REFUSALS} | {
        Reason.EXHAUSTED, Reason.RANK_COMMITTED, Reason.SPEC, Reason.UNKNOWN_SAMPLE,
        Reason.UNPLANNABLE, Reason.REFUSED, Reason.INTERNAL, Reason.UNAUTHENTICATED,
        Reason.UNREACHABLE}
    assert tested == set(Reason)


def test_errors_keep_their_reason_through_pickle():
    for error in (PlaneError("plane at x: get_plan: step 9: the mixture is exhausted",
                             Reason.EXHAUSTED),
                  RequestError("step 9 is too far ahead", Reason.TOO_FAR_AHEAD)):
        again = pickle.loads(pickle.dumps(error))
        assert (type(again), str(again), again.reason) == (type(error), str(error), error.reason)
    assert RequestError("no reason given").reason == Reason.REFUSED


class ServerWithoutLaneAction(PlaneServer):
    """A plane from before the plan lane: it does not know the ``lane`` action."""

    def do_action(self, context, action):
        if action.type == "lane":
            raise flight.FlightServerError("unknown action 'lane'")
        return super().do_action(context, action)


def test_a_server_without_the_lane_action_is_served_over_the_exchange(demo, tmp_path):
    plane = plane_at_step_2(demo, tmp_path / "state")
    server = serve(plane, lane=False, server_class=ServerWithoutLaneAction)
    client = PlaneClient(server.url, token=TOKEN, retry_for=5, stream=True)
    try:
        assert client.get_plan(2, 0).num_rows
        assert client._lane_port == 0 and client._stream is not None
        assert refused(lambda: client.get_plan(1, 0)).reason == Reason.COMMITTED
    finally:
        client.close()
        server.stop()
