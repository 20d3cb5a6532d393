"""The trainer: ``omniscale train CONFIG.yaml [--nproc N] [--resume RUN_DIR] [--set k=v …]``.

- :mod:`tools.train.config` -- the YAML run config (pydantic), ``--set`` overrides;
- :mod:`tools.train.launch` -- demo data, run directory, one process or N spawned ranks;
- :mod:`tools.train.loop` -- one rank: plane, loader, model, FSDP, the step, commits;
- :mod:`tools.train.build` -- model, optimizer, learning-rate curve;
- :mod:`tools.train.checkpoint` -- DCP model + optimizer + RNG with the plane snapshot;
- :mod:`tools.train.metrics` -- ``metrics.jsonl`` rows and the progress bar;
- :mod:`tools.train.evaluate` -- caption accuracy on the held-out split.
"""
