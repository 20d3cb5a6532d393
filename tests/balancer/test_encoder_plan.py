import numpy as np

from omniscale.balancer.encoder_plan import plan_encoders


def test_balances_items_when_it_pays():
    cost = np.array([10.0, 10.0, 10.0, 10.0])
    consume = np.array([0, 0, 0, 0])
    plan = plan_encoders(cost, np.full(4, 5), consume, 4, reshard_per_token=0.1)
    assert plan.reshard
    np.testing.assert_allclose(plan.encoder_cost_R, [10.0] * 4)
    assert sorted(plan.encode_rank_M.tolist()) == [0, 1, 2, 3]
    assert plan.saving == 30.0 and plan.comm == 0.1 * 15


def test_skips_when_communication_costs_more():
    plan = plan_encoders(np.array([10.0, 10.0]), np.array([1000, 1000]), np.array([0, 0]), 2,
                         reshard_per_token=1.0)
    assert not plan.reshard
    np.testing.assert_array_equal(plan.encode_rank_M, [0, 0])
    np.testing.assert_allclose(plan.encoder_cost_R, [20.0, 0.0])


def test_nothing_to_save_keeps_items_local():
    plan = plan_encoders(np.array([5.0, 5.0]), np.array([1, 1]), np.array([1, 0]), 2, 0.0)
    assert not plan.reshard
    np.testing.assert_array_equal(plan.encode_rank_M, [1, 0])
