"""Committing a whole step as a test's stand-in for every rank: fetch each rank's plan and
send the step fingerprint, as the plane requires of a whole-step commit."""

from __future__ import annotations

from omniscale.plan import fingerprint, step_fingerprint


def step_fp(plane, step: int, dp: int | None = None) -> str:
    """The step fingerprint of ``step`` (a DataPlane or a PlaneClient), fetching every plan."""
    if dp is None:
        dp = plane.dp_at(step) if hasattr(plane, "dp_at") else plane.status()["dp"]
    return step_fingerprint([fingerprint(plane.get_plan(step, r)) for r in range(dp)])


def commit_step(plane, step: int, dp: int | None = None) -> dict:
    return plane.commit(step, plan_fp=step_fp(plane, step, dp))
