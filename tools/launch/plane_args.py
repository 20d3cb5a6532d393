"""The ``omniscale plane serve`` flags that fit a training run, one per line.

``python -m omniscale.tools.launch.plane_args --world N CONFIG.yaml [train args ...]``

An external plane must plan as the run's embedded plane would (``tools.train.launch
.check_plane`` refuses another ``--dp``, a larger ``--sp-max``, any other planning setting --
batch and micro-batch tokens, window, policy, frozen towers, cost model -- or another next
step): the flags come from the function the trainer itself checks with (``load_config`` with
the same ``--set``, ``loop.planning_config``). ``--world``: the
job's processes over all nodes (the plane's ``--dp`` is their data ranks, ``world / (tp·pp)``).
The other arguments are those of ``omniscale train`` (unknown to this helper, ignored).

The plane reads the spec's indexes when it starts, so the data is prepared here as the
trainer's rank 0 would (the demo generated when the spec is missing, indexes brought up to
date; cheap when current) -- with the run's special tokens (``model.special_tokens`` over
the spec's), which the plane then plans with (its token counts are the indexes'; no flag
names them, and ``check_plane`` refuses a plane whose indexes were made with others). The
plane's state goes to ``RUN_DIR/plane``, where the embedded plane keeps it; with ``--resume``
the plane restores the checkpoint's step.

The plane starts from the cost model the embedded plane would: ``data.costs``'s calibration
(``--costs``), else the model's own FLOPs per sequence (``--cost-linear α/β --cost-quadratic
1``, ``ModelConfig.cost_coefficients``) -- the same settings, so a restart of the state dir
under either kind of plane is accepted (``dataplane.restore.check_settings``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from omniscale.errors import UserError


def serve_flags(cfg, run_dir, world: int, restore_step: int | None = None) -> list[str]:
    """``plane serve`` arguments for ``cfg`` (a ``RunConfig`` whose data is prepared) on
    ``world`` processes; every value is one list item."""
    from omniscale.tools.train.loop import planning_config

    config = planning_config(cfg, world)
    flags = ["--spec", cfg.data.spec, "--state-dir", str(run_dir / "plane"),
             "--dp", config.dp, "--sp-max", config.sp_max, "--balance", config.balance,
             "--window", config.window, "--global-batch-tokens", config.global_batch_tokens,
             "--micro-batch-tokens", config.micro_batch_tokens,
             "--snapshot-every", config.snapshot_every]
    if config.frozen_encoders:
        flags += ["--frozen-encoders", ",".join(config.frozen_encoders)]
    if config.interleave:
        flags += ["--interleave", ",".join(config.interleave)]
    if config.attention_heads:
        flags += ["--attention-heads", config.attention_heads]
    if config.rank_speed is not None:
        flags += ["--rank-speeds", ",".join(repr(v) for v in config.rank_speed)]
    if cfg.data.costs:
        flags += ["--costs", cfg.data.costs]
    else:  # repr round-trips a float exactly: the plane's settings equal the embedded one's
        flags += ["--cost-linear", repr(config.cost_linear),
                  "--cost-quadratic", repr(config.cost_quadratic)]
    if restore_step is not None:
        flags += ["--restore-step", restore_step]
    return [str(f) for f in flags]


def main(argv: list[str] | None = None) -> int:
    from omniscale.tools.cli import EXIT_USER_ERROR, build_parser
    from omniscale.tools.train import checkpoint
    from omniscale.tools.train.launch import ensure_data, resolve_config, resume_dir

    own = argparse.ArgumentParser(prog="plane_args", add_help=False)
    own.add_argument("--world", type=int, required=True,
                     help="the job's processes over all nodes")
    ours, rest = own.parse_known_args(argv)
    train_args = build_parser().parse_args(["train", *rest])
    try:
        if ours.world < 1:
            raise UserError(f"--world {ours.world}: must be >= 1")
        resume = resume_dir(train_args.config, train_args.resume, list(train_args.set or []))
        cfg, run_dir = resolve_config(train_args.config, resume, list(train_args.set or []))
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the flags only
            ensure_data(cfg)
        found = checkpoint.latest(run_dir) if resume else None
        flags = serve_flags(cfg, run_dir, ours.world, found[0] if found else None)
    except UserError as e:
        print(f"plane_args: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print("\n".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
