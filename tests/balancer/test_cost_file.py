"""The cost file's document: what calibrate writes is what the planner reads (hand-built cases)."""

from __future__ import annotations

import pytest

from omniscale.balancer.cost_file import cost_document, planner_costs


def test_planner_costs_of_a_written_document():
    llm = {"alpha": 2e-6, "beta": 3e-10, "gamma": 1e-4, "per_micro_batch": 0.02, "r2": 0.99}
    doc = cost_document(llm, {"image": {"alpha": 5e-7, "beta": 0.0, "gamma": 1e-3}},
                        device="cpu", model="tiny")
    doc["collectives"] = {"reshard_per_token": 4e-9, "something_else": 1.0}
    assert planner_costs(doc) == {
        "cost_linear": 2e-6, "cost_quadratic": 3e-10,
        "costs": {"llm": [2e-6, 3e-10, 1e-4], "micro_batch": 0.02,
                  "reshard_per_token": 4e-9,  # only the prices the planner knows
                  "image": [5e-7, 0.0, 1e-3],
                  "video": [0.0, 0.0, 0.0], "audio": [0.0, 0.0, 0.0]}}
    assert doc["unit"] == "seconds" and doc["device"] == "cpu"


def test_a_document_without_a_coefficient_is_refused():
    with pytest.raises(ValueError, match="image: no gamma"):
        cost_document({"alpha": 1, "beta": 1, "gamma": 0},
                      {"image": {"alpha": 1, "beta": 1}})
    with pytest.raises(ValueError, match="unknown kind text"):
        cost_document({"alpha": 1, "beta": 1, "gamma": 0},
                      {"text": {"alpha": 1, "beta": 1, "gamma": 0}})
    with pytest.raises(KeyError):
        planner_costs({"llm": {"alpha": 1.0}})
