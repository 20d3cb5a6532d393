"""``omniscale train``: resolve the config, make the demo data if needed, run the ranks, evaluate.

``--nproc 1`` trains in this process. ``--nproc N`` starts N processes with
``torch.multiprocessing`` (forked from a server that imported the trainer once:
``tools.train.fork_server``) that rendezvous over a gloo/nccl process group
through a file store in a temporary directory -- the single-machine launch. Under ``torchrun``
(any number of nodes) each process runs one rank through ``env://`` (``tools.train.torchrun``).
Rank 0
starts the embedded plane (dp = N) and broadcasts its URL. A rank's UserError comes back here
as one line (it is written to ``RUN_DIR/error-rankR.txt`` and the launcher raises it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path

import yaml

from omniscale.errors import UserError
from omniscale.tools.train import checkpoint
from omniscale.tools.train.build import resolve_towers
from omniscale.tools.train.config import (
    MISSING_SPEC,
    RunConfig,
    load_config,
    missing_spec,
    run_spec,
)
from omniscale.tools.train.fork_server import adopt_environment, launch_environment, start_method
from omniscale.tools.train.loop import RankJob, layout, train_rank
from omniscale.tools.train.torchrun import torchrun_layout, under_torchrun
from omniscale.tools.train.trackers import check_trackers

AUTO_RESUME = "auto"  # --resume auto: continue the config's run if it has a checkpoint


def resume_dir(config: str | None, resume: str | None, sets: list[str]) -> str | None:
    """What ``--resume`` names: ``auto`` is the run directory the config's ``output_dir``
    names when it holds a complete checkpoint (a requeued job continues), else None (a fresh
    start, which then refuses nothing); any other value as given (``./auto`` for a directory
    so named)."""
    if resume != AUTO_RESUME:
        return resume
    if config is None:
        raise UserError("--resume auto: give CONFIG.yaml too (its output_dir is the run "
                        "directory to continue)")
    cfg, _ = load_config(config, sets)
    return cfg.output_dir if checkpoint.latest(Path(cfg.output_dir)) is not None else None


def resolve_config(config: str | None, resume: str | None, sets: list[str]
                   ) -> tuple[RunConfig, Path]:
    """The run's config and directory. A resumed run reads ``RUN_DIR/config.yaml``, then applies
    ``--set`` (e.g. ``steps=200`` to train on); a fresh run refuses a directory with checkpoints."""
    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / "config.yaml").exists():
            raise UserError(f"--resume {resume}: no config.yaml there (not a run directory)")
        cfg, _ = load_config(run_dir / "config.yaml", sets)
        cfg.output_dir = str(run_dir)
        return cfg, run_dir
    if config is None:
        raise UserError("give a CONFIG.yaml (or --resume RUN_DIR)")
    cfg, _ = load_config(config, sets)
    run_dir = Path(cfg.output_dir)
    if checkpoint.latest(run_dir) is not None:
        raise UserError(f"output_dir {run_dir}: holds checkpoints of an earlier run "
                        f"(--resume {run_dir} to continue it, or --set output_dir=NEW)")
    return cfg, run_dir


def ensure_data(cfg: RunConfig) -> None:
    """Absolute spec paths; the demo (generated and indexed) when the spec is missing."""
    from omniscale.loaders.index import index_paths

    if cfg.data.spec is None:
        raise UserError(MISSING_SPEC)
    spec = Path(cfg.data.spec).resolve()
    if not spec.exists():
        if not cfg.data.demo:
            raise UserError(missing_spec(cfg.data.spec))
        from omniscale.tools.demo import generate

        generate(spec.parent, scale=cfg.data.demo_scale, progress=False)
        if not spec.exists():
            raise UserError(f"data.spec: {cfg.data.spec}: the demo has no such spec "
                            f"(it writes mix.yaml, eval.yaml, lm.yaml, video.yaml, sft.yaml and "
                              "sft_eval.yaml)")
    cfg.data.spec = str(spec)
    if cfg.data.costs:  # read now: a bad cost file is one line before anything starts
        from omniscale.tools.train.cost_model import read_cost_file

        cfg.data.costs = str(Path(cfg.data.costs).resolve())
        read_cost_file(cfg.data.costs)
    specs = [spec]
    if cfg.data.eval_spec and cfg.eval.enabled:  # no evaluation: the held-out split unread
        cfg.data.eval_spec = str(Path(cfg.data.eval_spec).resolve())
        if not Path(cfg.data.eval_spec).exists():
            raise UserError(f"data.eval_spec: {cfg.data.eval_spec}: no such file "
                            f"(or --set eval.enabled=false)")
        specs.append(Path(cfg.data.eval_spec))
    for path in specs:  # the run's special tokens: a clash is one line before any index
        run_spec(cfg, path)
    # Incremental (only changed shards, or an index of an older version): cheap when current.
    reports = index_paths(specs, progress=False,
                          special_tokens=cfg.model.special_tokens.named())
    bad = [line for r in reports for line in r.errors]
    if bad:
        print(f"omniscale train: {len(bad)} corrupt member(s) skipped by the index; first: "
              f"{bad[0]}")
    resolve_towers(cfg, run_spec(cfg, spec))  # model.vision/audio auto: RUN_DIR/config.yaml says


CPU_BIND = "OMNISCALE_CPU_BIND"  # "0,1": rank i runs on CPU i (of the list, cycling)


def cpu_bind(value: str | None) -> list[int] | None:
    """The CPUs of ``OMNISCALE_CPU_BIND`` (as ``srun --cpu-bind=map_cpu``: one per rank, the
    list cycling), None when unset; a bad list is one line naming the variable."""
    if not value:
        return None
    try:
        cpus = [int(c) for c in value.split(",")]
    except ValueError:
        cpus = []
    allowed = os.sched_getaffinity(0)
    if not cpus or any(c not in allowed for c in cpus):
        raise UserError(f"{CPU_BIND}={value}: expected a comma-separated list of CPUs this "
                        f"process may use ({', '.join(map(str, sorted(allowed)))})")
    return cpus


def _spawned(rank: int, world: int, job: RankJob, env: dict[str, str]) -> None:
    adopt_environment(env)
    cpus = cpu_bind(env.get(CPU_BIND))
    if cpus:  # before torch sizes its thread pool: this rank's CPU alone
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    try:
        train_rank(rank, world, job)
    except UserError as e:
        Path(job.run_dir, f"error-rank{rank}.txt").write_text(str(e) + "\n")
        raise SystemExit(2) from None


# Every setting an external plane plans with that must be the run's: (PlaneConfig field, the
# `plane serve` flag, where the run takes it from). dp and sp_max are checked apart (their
# messages say how the run's value is derived); snapshot_every is the plane's own business.
PLANNING_SETTINGS = (
    ("balance", "--balance", "data.balance"),
    ("interleave", "--interleave", "data.balance_interleave"),
    ("micro_batch_tokens", "--micro-batch-tokens", "data.micro_batch_tokens"),
    ("global_batch_tokens", "--global-batch-tokens", "data.global_batch_tokens"),
    ("global_batch_samples", "--global-batch-samples", "none (the run counts tokens)"),
    ("window", "--window", "data.window"),
    ("max_sample_tokens", "--max-sample-tokens", "none (what an SP group holds)"),
    ("frozen_encoders", "--frozen-encoders", "optim.groups' frozen towers"),
    ("rank_speed", "--rank-speeds", "data.rank_speeds"),
    ("attention_heads", "--attention-heads", "the model's query heads per TP rank, when "
                                             "parallel.sp > 1 and data.heads_by_speed"),
    ("costs", "--costs", "data.costs"),
    ("cost_linear", "--cost-linear", "data.costs, else the model's FLOPs (alpha/beta)"),
    ("cost_quadratic", "--cost-quadratic", "data.costs, else the model's FLOPs (1)"),
)


def check_plane(url: str, token: str | None, cfg: RunConfig, world: int, start: int) -> None:
    """An external plane must plan for this job as its embedded plane would: ``world``
    processes' data ranks, sequence-parallel groups no larger than ``parallel.sp``, every
    planning setting (:data:`PLANNING_SETTINGS`) equal to the run's, every source's index
    made with the run's special tokens, next step = the step the trainer starts at. A
    mismatch is one line naming both values (``plane_args`` prints the flags that fit)."""
    from omniscale.dataplane.client import PlaneClient
    from omniscale.tools.train.loop import planning_config

    expected = json.loads(json.dumps(dataclasses.asdict(planning_config(cfg, world))))
    try:
        with PlaneClient(url, token=token, timeout=10.0, retry_for=30.0) as client:
            status = client.status()
    except Exception as e:  # noqa: BLE001 -- unreachable, refused, bad token: one line
        raise UserError(f"--plane {url}: {str(e).splitlines()[0]}") from None
    config = status.get("config", {})
    if status["dp"] != expected["dp"]:
        raise UserError(f"--plane {url}: the plane plans for --dp {status['dp']}, this run for "
                        f"{expected['dp']} (--nproc / (tp·pp))")
    if config.get("sp_max", 1) > cfg.parallel.sp:
        raise UserError(f"--plane {url}: the plane may split samples over {config['sp_max']} "
                        f"ranks (--sp-max), this run's parallel.sp is {cfg.parallel.sp}")
    for field, flag, source in PLANNING_SETTINGS:
        if config.get(field) != expected[field]:
            raise UserError(f"--plane {url}: the plane's {flag} is {_shown(config.get(field))}, "
                            f"this run's is {_shown(expected[field])} ({source}); start the "
                            "plane with the flags `python -m omniscale.tools.launch.plane_args "
                            "--world N CONFIG.yaml ...` prints")
    _check_special_tokens(url, status, cfg)
    if status["next_step"] != start:
        raise UserError(f"--plane {url}: the plane's next step is {status['next_step']}, the "
                        f"run starts at step {start} (restart the plane with --restore-step "
                        f"{start})")


def _check_special_tokens(url: str, status: dict, cfg: RunConfig) -> None:
    """The plane budgets a sample with its index's token count, which leaves the media
    markers out: an index made with other special tokens than the run's (its spec's, or
    ``omniscale data index`` without the run's ``model.special_tokens``) plans other steps."""
    mine = dataclasses.asdict(run_spec(cfg, cfg.data.spec).special_tokens)
    planned = status.get("special_tokens")
    if planned is None:
        raise UserError(f"--plane {url}: the plane does not say which special tokens it plans "
                        "with (an older OmniScale?); this run's are "
                        f"{_shown(mine)} (model.special_tokens over the spec's special_tokens:)")
    for source, theirs in planned.items():
        if theirs is not None and theirs != mine:  # None: no tokenizer counted that source
            raise UserError(f"--plane {url}: the plane plans source {source!r} with special "
                            f"tokens {_shown(theirs)} (its index's), this run's are "
                            f"{_shown(mine)} (model.special_tokens over the spec's "
                            "special_tokens:); restart the plane with the flags `python -m "
                            "omniscale.tools.launch.plane_args --world N CONFIG.yaml ...` "
                            "prints (it indexes with the run's)")


def _shown(value) -> str:
    return "none" if value is None or value == [] else json.dumps(value)


def train(config: str | None, nproc: int = 1, resume: str | None = None,
          sets: list[str] = (), progress: bool = True, plane: str | None = None,
          plane_token: str | None = None) -> dict:
    """Train (and evaluate); returns ``{"run_dir", "steps", "start_step", "eval", "corrupt"}``
    (also in ``RUN_DIR/result.json``; ``corrupt``: :func:`corrupt_report`). ``plane``: the URL
    of an external data plane (``omniscale plane serve``); by default rank 0 embeds one."""
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: must be >= 1")
    rank, world = torchrun_layout(nproc, plane) if under_torchrun() else (0, 1)
    resume = resume_dir(config, resume, list(sets))
    cfg, run_dir = resolve_config(config, resume, list(sets))
    check_trackers(cfg)  # metrics.wandb without the package: one line before anything starts
    if rank == 0:
        ensure_data(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"),
                                                            sort_keys=False))
    else:  # rank 0 prepares the data before it joins the group; the others wait there
        if cfg.data.spec is None:
            raise UserError(MISSING_SPEC)
        cfg.data.spec = str(Path(cfg.data.spec).resolve())
    found = checkpoint.latest(run_dir) if resume is not None else None
    start = found[0] if found else 0
    if start >= cfg.steps:
        raise UserError(f"--resume {run_dir}: already at step {start} of steps={cfg.steps} "
                        f"(--set steps=N to train on)")
    notice = cfg.on_device(_device_type(cfg)).deterministic_notice()
    if notice and rank == 0:
        print(notice, flush=True)
    if world > 1:  # under torchrun: this process is one rank
        return _train_one_rank(cfg, run_dir, rank, world, start, found, progress, plane,
                               plane_token)
    for stale in run_dir.glob("error-rank*.txt"):
        stale.unlink()
    layout(cfg, nproc)  # an impossible layout: one line now, before any process starts
    cpu_bind(os.environ.get(CPU_BIND))  # a bad CPU list: one line now, too
    if plane is not None:
        check_plane(plane, plane_token, cfg, nproc, start)
    with tempfile.TemporaryDirectory(prefix="omniscale-pg-") as tmp, \
            job_ray_cluster(cfg, run_dir) as ray_address:
        job = RankJob(cfg.model_dump(mode="json"), str(run_dir), cfg.data.spec, start,
                      str(found[1]) if found else None, f"file://{tmp}/store", progress,
                      plane_url=plane, plane_token=plane_token, ray_address=ray_address)
        if nproc == 1:
            train_rank(0, 1, job)
        else:
            _spawn(job, nproc, run_dir)
    return _finish(cfg, run_dir, start, plane, plane_token)


def _device_type(cfg: RunConfig) -> str:
    """The ranks' device type (``loop.device_of``), for the defaults that depend on it."""
    import torch

    auto = "cuda" if torch.cuda.is_available() else "cpu"
    return auto if cfg.parallel.device == "auto" else cfg.parallel.device


@contextlib.contextmanager
def job_ray_cluster(cfg, run_dir: Path):
    """The Ray cluster the job's ranks share (``data.loader: ray``): ``data.ray_address``
    when set, else a Ray instance this launcher starts on this machine for the job and stops
    after it; None for worker processes."""
    if cfg.data.loader != "ray" or cfg.data.ray_address is not None:
        yield cfg.data.ray_address
        return
    import ray

    from omniscale.loaders.ray_cluster import job_namespace, start_local

    address = start_local(job_namespace(run_dir))
    try:
        yield address
    finally:
        ray.shutdown()


def _train_one_rank(cfg, run_dir: Path, rank: int, world: int, start: int, found, progress,
                    plane, plane_token) -> dict:
    """One rank of a torchrun launch (``tools.train.torchrun``); rank 0 evaluates after."""
    if rank == 0 and plane is not None:
        check_plane(plane, plane_token, cfg, world, start)
    job = RankJob(cfg.model_dump(mode="json"), str(run_dir), cfg.data.spec, start,
                  str(found[1]) if found else None, "env://", progress,
                  plane_url=plane, plane_token=plane_token)
    train_rank(rank, world, job)
    if rank != 0:
        return {"run_dir": str(run_dir), "steps": cfg.steps, "start_step": start}
    return _finish(cfg, run_dir, start, plane, plane_token)


def _finish(cfg, run_dir: Path, start: int, plane, plane_token) -> dict:
    """After training: the corrupt-sample report, the held-out evaluation, result.json."""
    result = {"run_dir": str(run_dir), "steps": cfg.steps, "start_step": start, "eval": None,
              "corrupt": corrupt_report(run_dir, cfg.steps, plane, plane_token),
              "suspect": suspect_report(run_dir, plane, plane_token)}
    if cfg.eval.enabled and cfg.data.eval_spec:
        result["eval"] = _final_eval(cfg, run_dir)
    (run_dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _final_eval(cfg, run_dir: Path) -> dict:
    """The last step's held-out results: the ranks' (``held_out``, RUN_DIR/eval.json), or when
    they wrote none for that step (a finished run resumed with evaluation newly on), the last
    checkpoint's evaluated here (``evaluate_run``)."""
    from omniscale.tools.train import evaluate

    done = run_dir / "eval.json"
    if done.exists():
        found = json.loads(done.read_text())
        if found.get("step") == cfg.steps:
            evaluate.report(cfg, evaluate.run_spec(cfg, cfg.data.eval_spec), found["eval"],
                            found["step"])
            return found["eval"]
    return evaluate.evaluate_run(cfg, run_dir)


MAX_LISTED = 100  # corrupt samples listed in result.json (the count is always whole)


def corrupt_report(run_dir: Path, steps: int, plane: str | None = None,
                   plane_token: str | None = None) -> dict:
    """What the run skipped as corrupt (``data.policy=skip``), also told in one line.

    ``skipped``: samples skipped, a sample once per step that skipped it, over every step of
    the run directory (a resumed run's earlier steps too) -- from the plane's log
    (``RUN_DIR/plane``: one record per report however many ranks decoded the sample), or, with
    an external plane, the metrics rows' ``skipped``. ``distinct``: how many samples that is.
    ``samples``: the first ones, in report order (an external plane's status keeps only its
    last reports)."""
    from omniscale.tools.train.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    counted = sum(int(r.get("skipped", 0)) for r in read_metrics(path)) if path.exists() else 0
    report = {"skipped": counted, "distinct": 0, "samples": []}
    if not counted:
        return report
    events, complete = _corrupt_events(run_dir, plane, plane_token)
    # Loaders decode ahead of the trainer, so the plane may have heard of samples of steps
    # never trained: those are left out.
    events = [{n: e[n] for n in ("step", "source", "shard", "key", "reason")}
              for e in events if e["step"] < steps]
    if complete:
        report["skipped"] = len(events)
    report["distinct"] = len({(e["source"], e["shard"], e["key"]) for e in events})
    report["samples"] = events[:MAX_LISTED]
    first = (f"; first: step {events[0]['step']}: {events[0]['source']}/{events[0]['key']} "
             f"({events[0]['shard']}): {events[0]['reason']}") if events else ""
    print(f"omniscale train: {report['skipped']} corrupt sample(s) skipped and replaced from "
          f"the same source ({report['distinct']} distinct, quarantined by the plane; listed "
          f"in {run_dir / 'result.json'}){first}", flush=True)
    return report


def suspect_report(run_dir: Path, plane: str | None = None,
                   plane_token: str | None = None) -> dict:
    """The steps the guard did not apply and their samples (``tools.train.guard``), from the
    plane's log (``RUN_DIR/plane``): ``{"steps": [{step, reason, samples: [{source, shard, key,
    epoch}]}], "samples": N}``; an external plane's status keeps its latest samples only
    (``recent``)."""
    found, whole = _plane_reports(run_dir, plane, plane_token, "suspect",
                                  lambda status: [status.get("suspect") or {}])
    if not whole and plane is None:  # its log could not be read (said in one line)
        return {"steps": [], "samples": 0}
    if not whole:
        suspect = found[0] if found else {}
        return {"recent": suspect.get("recent", []), "samples": suspect.get("samples", 0),
                "steps_skipped": suspect.get("steps", 0)}
    steps = [{n: r[n] for n in ("step", "reason", "samples")} for r in found]
    return {"steps": steps, "samples": sum(len(s["samples"]) for s in steps)}


def _corrupt_events(run_dir: Path, plane: str | None, plane_token: str | None
                    ) -> tuple[list[dict], bool]:
    """The plane's corrupt reports, and whether that is all of them."""
    return _plane_reports(run_dir, plane, plane_token, "corrupt",
                          lambda status: list(status.get("corrupt_recent", [])))


def _plane_reports(run_dir: Path, plane: str | None, plane_token: str | None, kind: str,
                   from_status) -> tuple[list[dict], bool]:
    """The ``kind`` records of the embedded plane's log, all of them (True), as the plane
    answered rank 0 before it stopped (``plane_session.PlaneSession.write_reports``); or what
    ``from_status`` takes from an external plane's status (False). Reports or a plane that
    cannot be read cost the names, in one line, not the run: ``([], False)``."""
    if plane is None:
        from omniscale.tools.train.plane_session import REPORTS_FILE

        path = run_dir / REPORTS_FILE
        try:
            found = json.loads(path.read_text())
            if "error" in found:
                raise ValueError(found["error"])
            return list(found[kind]), True
        except (OSError, ValueError, KeyError) as e:
            print(f"omniscale train: cannot list the {kind} samples ({e})")
            return [], False
    from omniscale.dataplane.client import PlaneClient

    try:
        with PlaneClient(plane, token=plane_token, timeout=10.0, retry_for=10.0) as client:
            return from_status(client.status()), False
    except Exception as e:  # noqa: BLE001 -- the plane may be gone by now
        print(f"omniscale train: cannot list the {kind} samples ({str(e).splitlines()[0]})")
        return [], False


def _spawn(job: RankJob, nproc: int, run_dir: Path) -> None:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    # When a rank stops (a UserError), torch logs "Terminating process N via signal SIGTERM"
    # for each rank still waiting on it: noise beside the one line that says why.
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    try:
        mp.start_processes(_spawned, args=(nproc, job, launch_environment()), nprocs=nproc,
                           join=True, start_method=start_method())
    except ProcessException:  # a rank's exit or exception: its peers' then follow
        # a rank that stopped on purpose (a UserError, the watchdog) left its line; a peer
        # that failed because it left (a broken collective) did not
        errors = sorted(run_dir.glob("error-rank*.txt"), key=lambda f: f.stat().st_mtime_ns)
        if errors:  # the first written: the rank that stopped the others
            raise UserError(errors[0].read_text().strip()) from None
        raise
    finally:
        spawn_log.setLevel(level)
