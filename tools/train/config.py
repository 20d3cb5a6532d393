"""The run config of ``omniscale train``: one YAML file, validated, plus ``--set`` overrides.

Every mistake is one line naming the file and the dotted key (``run.yaml: optim.lr: Input
should be greater than 0``), raised as :class:`omniscale.errors.UserError`. ``--set`` takes
``dotted.key=value`` with the value parsed as YAML (``--set optim.lr=3e-4 --set
model.overrides.n_layers=4``); an unknown key is an error there too, never silently ignored.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from omniscale.dataplane.plane_config import POLICIES
from omniscale.errors import UserError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class InitFromSection(_Strict):
    """Where the run's weights come from: Hugging Face checkpoint directories (any subset), or
    an earlier run of this model (``run``), e.g. fine-tuning from the main demo."""

    backbone: str | None = None  # Qwen3-MoE / Qwen3: the decoder's shapes and weights
    vision: str | None = None  # Qwen2-VL: the vision tower (sets the media geometry)
    audio: str | None = None  # Whisper / Qwen2-Audio: the audio tower
    # a run directory (its newest checkpoint) or one checkpoint directory: every weight, no
    # optimizer state or step (a new run; `--resume` continues one)
    run: str | None = None

    @model_validator(mode="after")
    def _one_kind(self):
        if self.run and (self.backbone or self.vision or self.audio):
            raise ValueError("run: either an earlier run or Hugging Face directories, not both")
        return self


class SpecialTokensSection(_Strict):
    """The tokenizer's tokens for these roles, named over the mixing spec's
    ``special_tokens:`` (a role left unset keeps the spec's; the spec's defaults are
    ``<pad> <eos> <image> <video> <audio>``). Texts mark media with these names."""

    pad: str | None = Field(None, min_length=1)  # padding
    eos: str | None = Field(None, min_length=1)  # end of a sample
    image: str | None = Field(None, min_length=1)  # an image's marker and placeholder
    video: str | None = Field(None, min_length=1)  # a clip's marker and placeholder
    audio: str | None = Field(None, min_length=1)  # an audio clip's marker

    def named(self) -> dict[str, str]:
        """The roles this run names, {role: token}."""
        return self.model_dump(exclude_none=True)


AUTO = "auto"  # model.vision / model.audio: a tower only for a spec with media of its kind


class ModelSection(_Strict):
    preset: Literal["tiny", "small", "1b", "30b_a3b"] = "tiny"  # unused with init_from.backbone
    overrides: dict = Field(default_factory=dict)  # ModelConfig fields (moe: a dict of MoEConfig)
    # The vision tower (images and clips): an encoders.vision.VisionConfig preset (tiny, small,
    # base), always built; None: none; auto: the tiny preset, built only when data.spec has a
    # source with images or clips (tools.train.spec_media: an image_caption or video_caption
    # source, or an interleaved or conversation source whose index holds them). A tower
    # model.init_from.vision gives is built whatever this says. A run writes the resolved value
    # to RUN_DIR/config.yaml.
    vision: str | None = AUTO
    # The audio tower: an encoders.audio.AudioConfig preset, None or auto, as model.vision
    # (auto: built only when data.spec has audio_caption sources or indexed audio)
    audio: str | None = AUTO
    encoder_overrides: dict = Field(default_factory=dict)  # {"vision": {...}, "audio": {...}}
    # A Hugging Face tower (model.init_from.vision / audio) whose projection to the LLM does
    # not fit the decoder's width -- another width, or none at all (Whisper) -- gets a
    # projector initialised from scratch, which must then be trained before the tower helps.
    # Off: such a run stops with one line naming the tower and both widths; on: allowed.
    fresh_projector: bool = False
    dit: str = "tiny"  # backbone.dit.DiTConfig preset of the video_gen task
    init_from: InitFromSection = Field(default_factory=InitFromSection)
    special_tokens: SpecialTokensSection = Field(default_factory=SpecialTokensSection)


class DataSection(_Strict):
    # The mixing spec to train on (docs/mixing-spec.md); relative paths: to the current
    # directory. Required by `omniscale train`: a run without one, or with one that does not
    # exist, stops with one line (demo data: `make demo`, or `omniscale data demo DIR` and
    # data.spec: DIR/mix.yaml, or data.demo: true).
    spec: str | None = None
    # The held-out mixing spec evaluation reads (None: no held-out evaluation)
    eval_spec: str | None = None
    # Generate and index the demo dataset (tools.demo) into data.spec's directory when
    # data.spec is missing -- for the demo configs (configs/demo_*.yaml); off, a missing
    # data.spec is an error, never a silent switch to generated data
    demo: bool = False
    demo_scale: Literal["tiny", "small", "medium"] = "tiny"  # with data.demo: its size
    global_batch_tokens: int = Field(12288, gt=0)  # tokens a step trains over all ranks
    micro_batch_tokens: int = Field(8192, gt=0)  # a micro-batch's token budget on a rank
    window: int = Field(4, ge=1)  # global batches the plane draws and plans together
    workers: int = Field(1, ge=0)  # decode processes per rank (0: decode in the loader thread)
    prefetch_steps: int = Field(2, ge=1)  # steps of batches a rank's loader reads ahead
    # Sources in object stores (s3://…): a node-local cache of their shards' bytes, shared by
    # the node's ranks and workers (None: read ranges straight from the store), its size cap,
    # and how many steps ahead the plans are fetched to fill it (the plane knows them)
    cache_dir: str | None = None
    cache_bytes: int = Field(8 << 30, gt=0)  # the node cache's size cap (bytes)
    cache_prefetch_steps: int = Field(4, ge=0)  # steps of plans fetched ahead to fill it
    policy: Literal["skip", "fail"] = "skip"  # a corrupt sample: skip and report, or stop
    loader: Literal["workers", "ray"] = "workers"  # DataLoader processes, or Ray source pools
    # The job's Ray cluster: None starts one on this machine for the job (the launcher's),
    # "auto" joins the one running here, HOST:PORT a remote head's
    ray_address: str | None = None
    # CPUs each Ray decoding actor reserves (None: the pools fit in the cluster's CPUs)
    ray_actor_cpus: float | None = Field(None, gt=0)
    ray_placement_timeout_s: float = Field(60.0, gt=0)  # then: one line and exit, not a hang
    # A cluster with an autoscaler: the CPUs the pools may ask it for (Ray resource requests;
    # None: the pools fit the nodes there are)
    ray_autoscale_cpus: float | None = Field(None, gt=0)
    # Refit the balancer's cost model from measured step times every N steps (0: never) and
    # send it to the plane. Under deterministic (true by default on CPU) the fit is computed
    # and logged (cost_refit in the metrics rows) but never sent: plans must depend on the
    # data alone so that a resumed run replays bit for bit; `omniscale train` says so in one
    # line at the start. For a refit that moves the plans, set deterministic: false.
    refit_costs_every: int = Field(50, ge=0)
    # Give each data rank work in proportion to its measured speed (rank_speeds: its compute
    # clock against its plans' cost): a slowed rank -- a noisy neighbour, a throttled or older
    # GPU -- gets less, and its share back when it recovers. Under deterministic the speeds
    # are measured and logged but the plane is not told (as for the refit above, and said in
    # the same start line).
    plan_by_rank_speed: bool = True
    # Each data rank's relative speed known ahead, in data-rank order (mixed GPU generations:
    # e.g. [1, 1, 0.5, 0.5]): plans give a rank work in proportion from step 0, a sample split
    # over an SP group included (a slower rank holds fewer of its tokens). Plans depend on
    # them alone, so they hold under deterministic; measured speeds (plan_by_rank_speed)
    # replace them once sent. None: equal ranks until measured.
    rank_speeds: list[float] | None = None
    # With rank speeds, a sample split over an SP group may also have its query heads sized by
    # the speeds (a slower rank attends fewer; ``balancer.speed_split``). False: H/k heads each
    # -- how a run's plane planned before this setting existed, so such a run resumes with it.
    heads_by_speed: bool = True
    # who places samples on ranks: the planner, or a baseline policy through the same plane
    # (to measure the planner's gain on this very run)
    balance: Literal[POLICIES] = "omniscale"  # type: ignore[valid-type] (plane_config.POLICIES)
    # A/B timing in one run: window k planned by balance_interleave[k % n] instead of balance
    # (e.g. [omniscale, token_lpt]): the policies take turns window by window, so a machine
    # whose speed drifts over minutes slows each alike; each metrics row names its step's
    # policy (tools/bench/e2e.py's interleaved schedule). None: every window by balance.
    balance_interleave: list[Literal[POLICIES]] | None = Field(  # type: ignore[valid-type]
        None, min_length=2)
    # the cost model from `omniscale balance calibrate` (seconds of this machine); default:
    # the model's FLOPs per sequence (the online refit moves either)
    costs: str | None = None


class ParamGroup(_Strict):
    """One entry of ``optim.groups`` (``tools.train.optim_groups``): the parameters whose plain
    name (``vision.blocks.0.qkv.weight``) matches the glob ``match`` train at ``lr_scale`` times
    the scheduled learning rate, or not at all (``frozen``). The first matching entry wins."""

    match: str = Field(min_length=1)  # a glob over parameter names (required)
    lr_scale: float | None = Field(None, gt=0)  # None: 1 (an entry that shields a subset)
    frozen: bool = False  # not trained at all (no optimizer state)

    @model_validator(mode="after")
    def _frozen_has_no_rate(self):
        if self.frozen and self.lr_scale is not None:
            raise ValueError(f"match {self.match!r}: lr_scale and frozen: true together (a "
                             f"frozen parameter has no learning rate)")
        return self

    @property
    def scale(self) -> float:
        return 1.0 if self.lr_scale is None else self.lr_scale


class OptimSection(_Strict):
    lr: float = Field(3e-3, gt=0)  # peak learning rate (AdamW)
    min_lr: float = Field(3e-4, ge=0)  # where the cosine decay ends
    warmup_steps: int = Field(10, ge=0)  # linear warm-up from 0 to lr
    decay_steps: int | None = Field(None, ge=1)  # cosine length (None: train.steps)
    weight_decay: float = Field(0.1, ge=0)  # on matrices; norms and biases none
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's
    grad_clip: float = Field(1.0, gt=0)  # the global gradient norm's clip
    # per-parameter learning-rate scales and freezing, first match wins (ParamGroup)
    groups: list[ParamGroup] = Field(default_factory=list)

    @model_validator(mode="after")
    def _min_below_peak(self):
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        return self


class ParallelSection(_Strict):
    """The run's layout (``parallel.mesh.ParallelDims``: docs/parallel.md, "Choosing a layout") and
    how each rank runs its part (``parallel.parallelize.Settings``)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when there is one
    dp_replicate: int = Field(1, ge=1)  # HSDP: replicas (e.g. nodes), each FSDP over dp_shard
    dp_shard: int = -1  # FSDP shard group; -1: the ranks the other axes leave
    tp: int = Field(1, ge=1)  # tensor parallelism (heads and FFN widths split)
    ep: int = Field(1, ge=1)  # experts split over ep of the dp_shard·sp ranks (adds no ranks)
    # Ulysses sequence parallelism with the plane's long-short split: a sample longer than a
    # micro-batch is split over an aligned group of up to sp ranks (a power of two)
    sp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)  # pipeline stages
    pp_schedule: Literal["gpipe", "1f1b"] = "1f1b"  # the pipeline's schedule
    # micro-batches per schedule run (lm task): a step's run in chunks of this many, the last
    # filled with padding; more shrinks the pipeline bubble, each is padded to the budget
    pp_microbatches: int = Field(4, ge=1)
    encoder_dp_shard: int = -1  # the encoders' own FSDP group (-1: every rank)
    encoder_tp: int = Field(1, ge=1)  # tensor parallelism of the encoders
    # recompute activations in backward: none, selective (attention kept) or full blocks
    activation_checkpoint: Literal["none", "selective", "full"] = "none"
    # bf16: bf16 parameters for compute, fp32 gradient reduction and master weights; auto:
    # bf16 on CUDA, fp32 on CPU
    mixed_precision: Literal["auto", "fp32", "bf16"] = "auto"
    compile: bool = False  # torch.compile every decoder and encoder block
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: parameters and optimizer state on host
    peak_tflops: float | None = Field(None, gt=0)  # per device, for MFU (GPUs known by name)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "sp_max" in data:
            raise ValueError("sp_max was renamed sp (the same long-short split, now also the "
                             "mesh's SP axis)")
        return data

    @field_validator("sp")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two, got {value}")
        return value

    @field_validator("dp_shard", "encoder_dp_shard")
    @classmethod
    def _size_or_rest(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(f"must be >= 1, or -1 for the ranks the other axes leave, got "
                             f"{value}")
        return value

    @model_validator(mode="after")
    def _offload_needs_a_device(self):
        if self.cpu_offload and self.device == "cpu":
            raise ValueError("cpu_offload: the parameters already live on the CPU")
        return self


class EvalSection(_Strict):
    enabled: bool = True  # held-out evaluation of data.eval_spec (needs one)
    max_samples: int = Field(32, ge=1)  # per caption source
    # held-out evaluation every N steps during training, on the sharded model (0: only after
    # training); results in the metrics rows and the report
    every: int = Field(0, ge=0)


class GuardSection(_Strict):
    """The update guard (``tools.train.guard``): a step whose loss or gradient norm is not
    finite, or whose loss is above ``spike_factor`` times the median of the last
    ``spike_window`` applied steps, is not applied; its samples go to the plane as suspect."""

    enabled: bool = True  # off: every step is applied
    spike_factor: float = Field(5.0, gt=1)  # a loss above this x the recent median: a spike
    spike_window: int = Field(50, ge=1)  # applied steps the median is over
    min_history: int = Field(10, ge=1)  # no spike verdict before this many applied steps
    max_skipped_steps: int = Field(3, ge=1)  # in a row: then the run stops with one line


class WatchdogSection(_Strict):
    """Hangs (``tools.train.watchdog``) and stragglers (``tools.train.stragglers``)."""

    # no step finished for this long (the first step: twice it, for compilation): every
    # thread's stack to RUN_DIR/hang-rankR.txt and the run exits with one line (0: off)
    step_timeout_s: float = Field(900.0, ge=0)
    # the process group's collective time-out (torch's own default: 10 min NCCL, 30 min gloo)
    collective_timeout_s: float = Field(1800.0, gt=0)
    # a rank whose compute seconds exceed the plan's prediction for it by this factor (the
    # cost model fitted over all ranks) for ``straggler_steps`` steps in a row is named
    straggler_factor: float = Field(1.5, gt=1)
    straggler_steps: int = Field(5, ge=1)  # steps in a row before a straggler is named


class ProfileSection(_Strict):
    # torch.profiler over steps [first, last] (inclusive) into RUN_DIR/profile (Chrome trace
    # format, one file per rank); None: no profiling
    steps: tuple[int, int] | None = None

    @field_validator("steps")
    @classmethod
    def _ordered(cls, value):
        if value is not None and not 0 <= value[0] <= value[1]:
            raise ValueError(f"must be [first, last] with 0 <= first <= last, got {list(value)}")
        return value


class WandbSection(_Strict):
    """Weights & Biases (the ``wandb`` package, an optional extra): the same rows as
    metrics.jsonl and TensorBoard."""

    project: str = Field(min_length=1)  # the W&B project (required)
    entity: str | None = None  # team or user (default: the login's)
    name: str | None = None  # default: the run directory's name
    group: str | None = None  # runs shown together
    tags: list[str] = Field(default_factory=list)  # labels on the run
    mode: Literal["online", "offline", "disabled"] = "online"  # offline: synced later


class MetricsSection(_Strict):
    wandb: WandbSection | None = None  # the rows in Weights & Biases too (None: not)


class CheckpointSection(_Strict):
    # keep the newest N complete checkpoints, deleting older ones once a new one is complete
    # (0: keep every one); the plane's own snapshots in RUN_DIR/plane are not touched
    keep_last: int = Field(0, ge=0)
    # write the files in the background (torch DCP async_save): training goes on once the
    # state is copied to host memory; the checkpoint is complete (meta.json) when written
    async_save: bool = False
    # a checkpoint after the last step too (off: only every checkpoint_every steps -- a
    # benchmark or smoke run that need not write a model-sized checkpoint at its end)
    final: bool = True


class PoisonSection(_Strict):
    """A test's fault (``debug.poison``): at ``step``, ``rank``'s loss becomes NaN (``nan``)
    or ``factor`` times itself (``spike``) before the backward pass."""

    step: int = Field(ge=0)  # the step whose loss is poisoned
    rank: int = Field(0, ge=0)  # the rank whose loss
    kind: Literal["nan", "spike"] = "nan"  # NaN, or a spike of factor x the loss
    factor: float = Field(100.0, gt=1)  # the spike's


class HangSection(_Strict):
    """A test's hang (``debug.hang``): ``rank`` sleeps ``seconds`` inside step ``step``."""

    step: int = Field(ge=0)  # the step that hangs
    rank: int = Field(0, ge=0)  # the rank that hangs
    seconds: float = Field(3600.0, gt=0)  # how long it sleeps


class SlowRankSection(_Strict):
    """A test's straggler (``debug.slow_rank``): data rank ``rank`` computes ``seconds``
    longer at every step from ``from_step`` (``faults.Faults.in_compute``)."""

    rank: int = Field(0, ge=0)  # the slow data rank
    seconds: float = Field(gt=0)  # extra compute seconds a step
    from_step: int = Field(0, ge=0)  # from this step on


class DebugSection(_Strict):
    # Write every parameter's gradient (before clipping, gathered from the FSDP shards) at
    # this step to RUN_DIR/grads-step-N.pt (tools.train.faults.Faults.before_clip; omni and lm).
    dump_grads_at_step: int | None = Field(None, ge=0)
    poison: PoisonSection | None = None  # a test's bad loss (None: none)
    # a test's kill -9 of rank 0 while it saves the checkpoint of this step: after every
    # other file, before meta.json (synchronous saves)
    kill_in_save: int | None = Field(None, ge=1)
    hang: HangSection | None = None  # a test's hang (None: none)
    slow_rank: SlowRankSection | None = None  # a test's straggler (None: none)
    # tools.train.step_audit: inside each step's compute, a tensor created without naming its
    # device is a meta tensor (unusable) and a collective refuses a tensor off the step's
    # device -- a CPU run finds what would stop a GPU run at step 0
    audit_devices: bool = False
    # count the operations that would make the host wait for a GPU (item, tolist, nonzero,
    # bincount, ...): `host_syncs` and `host_syncs_per_micro_batch` in each metrics row
    count_host_syncs: bool = False


class RunConfig(_Strict):
    task: Literal["omni", "lm", "video_gen"] = "omni"  # what the run trains (docs/training.md)
    seed: int = 0  # weights' initialisation and every drawn number
    steps: int = Field(100, ge=1)  # optimizer steps the run trains in all
    checkpoint_every: int = Field(50, ge=1)  # steps between checkpoints
    # metrics stay on the device and are reduced and written once per log_every steps (one
    # row per step all the same; a checkpoint logs first). Default: every step on CPU, every
    # 10th on a GPU (reading the metrics waits for the device: once per interval)
    log_every: int | None = Field(None, ge=1)
    # the run directory (checkpoints, metrics, plane state); a fresh run refuses one that
    # holds checkpoints
    output_dir: str = "runs/train"
    # torch.use_deterministic_algorithms and plans that depend on the data alone: bit-exact
    # resume. Default: on for CPU runs, off on GPUs (there it slows kernels, fills new tensors
    # with NaN and warns on every cuBLAS call unless CUBLAS_WORKSPACE_CONFIG is set). On, the
    # timing-driven planning is measured and logged only: data.refit_costs_every does not
    # send its fit and data.plan_by_rank_speed does not send the speeds (one line at start
    # says which of them this run turns off).
    deterministic: bool | None = None
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    guard: GuardSection = Field(default_factory=GuardSection)
    watchdog: WatchdogSection = Field(default_factory=WatchdogSection)
    profile: ProfileSection = Field(default_factory=ProfileSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    debug: DebugSection = Field(default_factory=DebugSection)

    @property
    def decay_steps(self) -> int:
        return self.optim.decay_steps or self.steps

    def on_device(self, device_type: str) -> "RunConfig":
        """This config with the defaults that depend on the device filled in
        (``deterministic``, ``log_every``)."""
        gpu = device_type != "cpu"
        return self.model_copy(update={
            "deterministic": (not gpu) if self.deterministic is None else self.deterministic,
            "log_every": (10 if gpu else 1) if self.log_every is None else self.log_every})

    def deterministic_notice(self) -> str | None:
        """One line naming what deterministic mode turns off in this run (the timing-driven
        planning its ``data`` asks for), or None; on a config with the device filled in
        (:meth:`on_device`)."""
        if not self.deterministic:
            return None
        off = []
        if self.data.refit_costs_every:
            off.append(f"data.refit_costs_every={self.data.refit_costs_every} fits the cost "
                       f"model but does not send it")
        if self.data.plan_by_rank_speed:
            off.append("data.plan_by_rank_speed measures the ranks' speeds but does not plan "
                       "by them")
        if not off:
            return None
        return (f"omniscale train: deterministic: {' and '.join(off)} (plans depend on the "
                f"data alone, for a bit-exact resume; deterministic: false to use them)")


def apply_set(raw: dict, assignment: str) -> None:
    """Apply one ``dotted.key=value`` (value parsed as YAML) to the raw config dict."""
    key, sep, value = assignment.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {assignment!r}: expected KEY=VALUE (e.g. optim.lr=1e-3)")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        raise UserError(f"--set {key}: value {value!r} is not valid YAML") from None
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"--set {key}: {part} is not a section")
        node = child
    node[parts[-1]] = parsed


def _where(error: dict) -> str:
    """The dotted key, list items by index (``optim.groups[1].lr_scale``)."""
    where = ""
    for part in error["loc"]:
        where += f"[{part}]" if isinstance(part, int) else f".{part}"
    return where.lstrip(".") or "(top level)"


def load_config(path: str | Path | None, sets: list[str] = (), name: str | None = None
                ) -> tuple[RunConfig, dict]:
    """The validated config and the raw dict it came from (saved into the run directory)."""
    label = name or (str(path) if path else "config")
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise UserError(f"{label}: cannot read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise UserError(f"{label}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{label}: expected a mapping of config keys")
    for assignment in sets:
        apply_set(raw, assignment)
    try:
        return RunConfig.model_validate(raw), raw
    except ValidationError as e:
        err = e.errors()[0]
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        got = f", got {err.get('input')!r}"
        if err["type"] in ("extra_forbidden", "value_error"):  # the message names the value
            msg, got = msg.removeprefix("Value error, "), ""
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise UserError(f"{label}: {_where(err)}: {msg}{got}{more}") from None


DEMO_DATA = ("demo data: `make demo`, or `omniscale data demo DIR` then data.spec: "
             "DIR/mix.yaml, or data.demo: true to generate it at data.spec")
MISSING_SPEC = f"data.spec: not set: name the mixing spec to train on ({DEMO_DATA})"


def missing_spec(path) -> str:
    """The one line for a ``data.spec`` that does not exist (data.demo off)."""
    return f"data.spec: {path}: no such file ({DEMO_DATA})"


def run_spec(cfg: RunConfig, path):
    """The mixing spec at ``path`` as this run reads it: ``model.special_tokens`` named over
    the spec's own (the launcher indexes with them too: ``launch.ensure_data``)."""
    from omniscale.dataplane.spec import load_spec

    if path is None:
        raise UserError(MISSING_SPEC)
    spec = load_spec(path)
    named = cfg.model.special_tokens.named()
    if not named:
        return spec
    tokens = dataclasses.replace(spec.special_tokens, **named)
    if not tokens.distinct():
        raise UserError(f"model.special_tokens: each role needs a token of its own, got "
                        f"{dataclasses.asdict(tokens)} (over {path}'s)")
    return dataclasses.replace(spec, special_tokens=tokens)
