"""A window's plan tables built at once (``window_rank_tables``) are, table for table and
metadata included, those built one step at a time -- on demo windows that hold every
modality, SP-split samples, encoder items on other ranks and a step of several micro-batches."""

from __future__ import annotations

import pytest

from omniscale.dataplane.plan_table import rank_tables, window_rank_tables
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.plan import fingerprint, plan_metadata
from tests.loaders.pipeline_fixtures import all_modalities_spec

CONFIGS = {
    "dp2-sp2": PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                           sp_max=2, snapshot_every=4),
    "dp3": PlaneConfig(dp=3, micro_batch_tokens=4096, window=4, global_batch_tokens=24576,
                       sp_max=1, snapshot_every=4),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_window_at_once_equals_its_steps_one_by_one(demo, tmp_path, name):
    plane = DataPlane(all_modalities_spec(demo), tmp_path / "state", CONFIGS[name])
    kinds, split = set(), False
    for k in range(3):
        window, _ = plane.state.window_of(k * CONFIGS[name].window)
        n = len(window.plans)
        steps = [window.first_step + j for j in range(n)]
        sides = [{"baseline_cost": float(j)} for j in range(n)]  # any side metadata
        first_item_N = window.samples.item_offsets_N1[:-1]
        prints: dict = {}
        at_once = window_rank_tables(window.plans, window.refs, first_item_N, steps,
                                     window.dp_of_step, sides, prints=prints)
        assert len(at_once) == len(prints) == sum(window.dp_of_step)
        assert all(prints[key] == fingerprint(table) for key, table in at_once.items())
        for j, step in enumerate(steps):
            alone = rank_tables(window.plans[j], window.refs, first_item_N, step,
                                window.dp_of_step[j], sides[j])
            for r, table in enumerate(alone):
                got = at_once[(step, r)]
                assert got.equals(table), (step, r)
                assert plan_metadata(got) == plan_metadata(table)
                rows = table.to_pylist()
                kinds |= {row["item_kind"] for row in rows}
                split |= any(row["sp_size"] and row["sp_size"] > 1 for row in rows)
    assert {"image", "video", "audio"} <= kinds  # the windows held encoder rows of each kind
    assert split or name != "dp2-sp2"
