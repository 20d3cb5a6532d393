"""The run config's device-dependent defaults (``RunConfig.on_device``): deterministic
algorithms and a metrics row written every step on CPU; on a GPU neither (deterministic mode
slows kernels and warns on every cuBLAS call; reading metrics waits for the device)."""

from __future__ import annotations

from omniscale.tools.train.config import RunConfig


def test_defaults_follow_the_device():
    cfg = RunConfig()
    assert cfg.deterministic is None and cfg.log_every is None  # decided per device
    cpu, gpu = cfg.on_device("cpu"), cfg.on_device("cuda")
    assert (cpu.deterministic, cpu.log_every) == (True, 1)
    assert (gpu.deterministic, gpu.log_every) == (False, 10)


def test_explicit_values_win_on_every_device():
    cfg = RunConfig(deterministic=True, log_every=3)
    for device in ("cpu", "cuda"):
        chosen = cfg.on_device(device)
        assert (chosen.deterministic, chosen.log_every) == (True, 3)
    assert RunConfig(deterministic=False).on_device("cpu").deterministic is False
