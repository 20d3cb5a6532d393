import numpy as np
import pytest

from balancer.cost import CostModel, Costs, fit


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
