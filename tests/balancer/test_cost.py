import numpy as np
import pytest

from omniscale.balancer.cost import CommModel, CostModel, Costs, fit
from omniscale.balancer.split import unit_cost


def test_cost_model_is_quadratic():
    model = CostModel(alpha=2.0, beta=0.5, gamma=3.0)
    np.testing.assert_allclose(model(np.array([0, 1, 10])), [3.0, 5.5, 73.0])
    assert model(np.array([4])).dtype == np.float64


def test_from_model_dims_follows_flops():
    costs = Costs.from_model_dims(1_000, 4, 64, encoder=((100, 2, 32), None, (50, 1, 16)))
    assert costs.llm == CostModel(6_000.0, 6.0 * 4 * 64, 0.0)
    assert costs.encoders[0] == CostModel(600.0, 12.0 * 2 * 32, 0.0)  # bidirectional
    assert costs.encoders[1] == CostModel(0.0, 0.0, 0.0)
    assert costs.encoders[2].beta == 12.0 * 16
    assert Costs.from_model_dims(1, 1, 1).encoders == (CostModel(0.0, 0.0),) * 3


def test_fit_recovers_known_model_from_single_sequences():
    lengths = np.array([128, 512, 1000, 2048, 4096, 8192, 16384])
    truth = CostModel(alpha=24576.0, beta=1.0, gamma=5e6)
    result = fit(lengths, truth(lengths))
    assert result.model.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert result.model.beta == pytest.approx(truth.beta, rel=1e-6)
    assert result.model.gamma == pytest.approx(truth.gamma, rel=1e-4)
    assert result.r2 == pytest.approx(1.0, abs=1e-9)
    assert result.mape < 1e-6


def test_fit_recovers_known_model_from_step_times():
    rng = np.random.default_rng(0)
    truth = CostModel(alpha=3.0, beta=0.01, gamma=100.0)
    steps = [rng.integers(1, 4000, rng.integers(1, 20)) for _ in range(30)]
    times = [truth(s).sum() for s in steps]
    result = fit(steps, times)
    np.testing.assert_allclose([result.model.alpha, result.model.beta, result.model.gamma],
                               [3.0, 0.01, 100.0], rtol=1e-6)
    assert result.r2 == pytest.approx(1.0, abs=1e-9)


def test_fit_reports_noise():
    rng = np.random.default_rng(1)
    lengths = rng.integers(100, 10000, 200)
    times = CostModel(1.0, 0.001)(lengths) * rng.normal(1.0, 0.05, 200)
    result = fit(lengths, times)
    assert 0.8 < result.r2 < 1.0
    assert 0.005 < result.mape < 0.1


def test_fit_refuses_too_few_measurements():
    with pytest.raises(ValueError, match="2 measurements cannot determine 3 parameters"):
        fit([100, 200], [1.0, 2.0])
    with pytest.raises(ValueError, match="do not determine"):
        fit([100, 100, 100, 100], [1.0, 1.0, 1.1, 0.9])
    with pytest.raises(ValueError, match="times_T"):
        fit([1, 2, 3], [1.0, 2.0])


# One sample of 1000 tokens split over k = 2 ranks; hidden 1024, 2 layers, 2 bytes a value,
# 1 GB/s, a cost unit = 1 µs. Each rank holds 500 tokens and sends half of them (k-1)/k: per
# layer and direction 4 tensors (q, k, v, out) x 250 tokens x 1024 x 2 bytes = 2,048,000
# bytes; x 2 layers x 2 (forward, backward) = 8,192,000 bytes = 8.192 ms = 8192 units.
HAND = CommModel(hidden=1024, layers=2, dtype_bytes=2, bandwidth=1e9, unit_seconds=1e-6)


def test_sp_comm_of_a_hand_computed_split():
    assert HAND.sp_bytes_per_token == 2 * 4 * 2 * 1024 * 2
    assert HAND.sp_comm(1000, 2) == pytest.approx(8192.0)
    assert HAND.sp_comm(1000, 1) == 0.0  # whole: no all-to-all
    # k = 4: 250 tokens a rank, 3/4 sent: 4 x 187.5 x 1024 x 2 x 2 x 2 B = 6.144 ms
    assert HAND.sp_comm(1000, 4) == pytest.approx(6144.0)
    costs = Costs.from_llm(10.0, 0.0, **HAND.collectives())
    # per token of a rank's slice when it sends all of it: 8192 units / (500 x 1/2)
    assert costs.sp_comm_per_token == pytest.approx(8192.0 / 250)
    # what one rank of the group carries: half the compute plus its all-to-all
    assert unit_cost(np.array([10_000.0]), np.array([1000]), np.array([2]),
                     costs.sp_comm_per_token)[0] == pytest.approx(5000.0 + 8192.0)


def test_reshard_bytes_and_free_bandwidth():
    # an item's 100 LLM tokens: 100 x 1024 x 2 bytes out, the gradient back: 409,600 B
    assert HAND.collectives()["reshard_per_token"] * 100 == pytest.approx(409.6)
    free = CommModel(bandwidth=float("inf"))
    assert free.collectives() == {"sp_comm_per_token": 0.0, "reshard_per_token": 0.0}
    default = CommModel()  # 7B-like shape, bf16, 25 GB/s, 6*32*4096 FLOPs at 400 TFLOP/s
    assert default.sp_bytes_per_token == 2 * 4 * 32 * 4096 * 2
    assert default.unit_seconds == pytest.approx(1.96608e-9)
    with pytest.raises(ValueError, match="bandwidth"):
        CommModel(bandwidth=0.0)
