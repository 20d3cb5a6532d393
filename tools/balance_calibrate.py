"""``omniscale balance calibrate CONFIG [--out costs.json]``: the balancer's cost model measured
on the run's own model, on this machine.

The backbone runs forward + backward over a grid of packed micro-batches (mixes of short and
long sequences up to the run's ``micro_batch_tokens``); ``balancer.cost.fit`` fits
``α·ΣL + β·ΣL² + γ·n + δ`` (n sequences; δ a micro-batch's fixed cost, which the planner
weighs per micro-batch slot) to the seconds. Held-out mixes drawn at random, never in
the fit, give the R² and MAPE that say whether the model predicts. Each encoder runs forward
+ backward over a grid of item sizes (image and video patches, audio mel frames) and gets its
own ``α·s + β·s² + γ`` per item.

The JSON (``--out``) is what ``data.costs`` and ``plane serve --costs`` read: the plane then
plans in seconds of this machine (``PlaneConfig.costs``), and the trainer's online refit
starts from it. Every time is the median of ``--repeats`` runs. On CUDA each shape gets a
warm-up run first (kernel choice, the allocator's pools); on CPU, where the first run at a
shape costs what the others do, one warm-up run per model part is enough.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from omniscale.balancer.cost import fit, nonnegative_lstsq
from omniscale.balancer.cost_file import cost_document
from omniscale.errors import UserError
from omniscale.tools.calibrate_layout import measure as measure_layout

MIN_SEQ = 16  # the shortest sequence of the grid (tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(run, device: torch.device, repeats: int) -> float:
    if device.type == "cuda":
        run()  # warm-up: a new shape picks its kernels and grows the allocator's pools
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def backbone_mixes(budget: int, rng: np.random.Generator, held_out: int
                   ) -> tuple[list[list[int]], list[list[int]]]:
    """(grid, held-out) micro-batches as lists of sequence lengths, each at most ``budget``
    tokens: the grid fills fractions of the budget with sequences of one length, and with one
    long sequence among short ones; held-out mixes draw lengths log-uniformly."""
    lengths = sorted({max(MIN_SEQ, budget >> k) for k in range(0, 8)})
    grid = []
    for n in lengths:
        for fill in (0.25, 0.5, 1.0):
            count = max(1, int(budget * fill) // n)
            grid.append([n] * count)
    for long in lengths[-3:]:
        short = lengths[0]
        grid.append([long] + [short] * ((budget - long) // short))
    mixes = []
    while len(mixes) < held_out:
        mix, total = [], 0
        target = int(rng.integers(budget // 4, budget + 1))
        while True:
            n = int(np.exp(rng.uniform(np.log(MIN_SEQ), np.log(budget))))
            if total + n > target:
                break
            mix.append(n)
            total += n
        if mix and mix not in grid:
            mixes.append(mix)
    return grid, mixes


def _backbone_step(model, lengths: list[int], device: torch.device):
    decoder = model.decoder
    vocab = decoder.config.vocab_size
    g = torch.Generator().manual_seed(sum(lengths))
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g).to(device)
    labels = torch.randint(0, vocab, (sum(lengths),), generator=g).to(device)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device=device)

    def run():
        model.zero_grad(set_to_none=True)
        hidden, aux = decoder(decoder.embed_tokens(ids), pos, cu, max(lengths))
        loss, _ = decoder.loss(hidden, labels)
        (loss + aux["router_loss"]).backward()
    return run


def _encoder_step(model, kind: str, size: tuple[int, ...], device: torch.device):
    """Forward + backward of one item: an image (1, h, w) or clip (t, h, w) grid of patches,
    or ``size[0]`` audio frames."""
    encoder = model.audio if kind == "audio" else model.vision
    g = torch.Generator().manual_seed(0)
    if kind == "audio":
        inputs = (torch.randn(size[0], encoder.config.n_mels, generator=g).to(device),
                  torch.tensor([size[0]], device=device))
    else:
        patches = int(np.prod(size))
        inputs = (torch.randn(patches, encoder.config.patch_dim, generator=g).to(device),
                  torch.tensor([list(size)], device=device))

    def run():
        model.zero_grad(set_to_none=True)
        encoder(*inputs).float().square().mean().backward()
    return run


def encoder_grids(model, geometry) -> dict[str, list[tuple[int, ...]]]:
    """Item sizes per encoder kind the model has, within the spec's media geometry."""
    grids = {}
    if model.vision is not None:
        m = geometry.merge_size
        sides = [m * k for k in (1, 2, 4, 8, 12, 16)]
        limit = geometry.max_pixels // geometry.patch_size ** 2
        grids["image"] = [(1, h, h) for h in sides if h * h <= limit] or [(1, m, m)]
        frames = geometry.video_max_frames // geometry.temporal_patch_size
        video_limit = geometry.video_max_pixels // geometry.patch_size ** 2
        side = max((s for s in sides if s * s <= video_limit), default=m)
        grids["video"] = [(t, side, side) for t in (1, 2, 4, 8, 16) if t <= frames]
    if model.audio is not None:
        most = int(geometry.audio_max_seconds * geometry.audio_sample_rate / geometry.mel_hop)
        grids["audio"] = [f for f in (100, 200, 500, 1000, 2000, 3000) if f <= most]
        grids["audio"] = [(f,) for f in grids["audio"]]
    return grids


def _model_fit(features, seconds) -> dict:
    result = fit(features, seconds, nonnegative=True)
    m = result.model
    return {"alpha": m.alpha, "beta": m.beta, "gamma": m.gamma, "r2": round(result.r2, 4),
            "mape": round(result.mape, 4)}


def _mix_rows(mixes: list[list[int]]) -> np.ndarray:
    """[ΣL, ΣL², n, 1] per micro-batch."""
    return np.array([[sum(m), sum(n * n for n in m), len(m), 1.0] for m in mixes], np.float64)


def _scores(pred: np.ndarray, t: np.ndarray) -> dict:
    ss_res, ss_tot = float(((t - pred) ** 2).sum()), float(((t - t.mean()) ** 2).sum())
    return {"r2": round(1 - ss_res / ss_tot, 4) if ss_tot > 0 else None,
            "mape": round(float(np.median(np.abs(pred - t) / t)), 4)}


def backbone_fit(grid: list[list[int]], grid_s: list[float], mixes: list[list[int]],
                 mixes_s: list[float]) -> dict:
    """``α·ΣL + β·ΣL² + γ·n + δ`` (all ≥ 0) fitted on the grid, scored on the held-out mixes.
    δ is a micro-batch's fixed cost (launches, the LM head's setup), paid on every rank once
    per micro-batch slot: the planner weighs it against the balance an extra slot would buy
    (``Costs.micro_batch``)."""
    A, t = _mix_rows(grid), np.asarray(grid_s)
    scale = A.max(axis=0)
    coef = nonnegative_lstsq(A / scale, t) / scale
    held = _scores(_mix_rows(mixes) @ coef, np.asarray(mixes_s))
    return {"alpha": float(coef[0]), "beta": float(coef[1]), "gamma": float(coef[2]),
            "per_micro_batch": float(coef[3]), **_scores(A @ coef, t),
            "held_out": {**held, "mixes": len(mixes)}}


def calibrate(config: str, sets: list[str] = (), repeats: int = 3, held_out: int = 12,
              progress=print, nproc: int = 1) -> dict:
    """Measure and fit (module docstring); returns the JSON document. ``nproc``: the ranks
    the run puts on this machine; on CPU every measurement gets the threads one of them gets
    (``tools.train.loop``), so the fit prices what a rank does."""
    from omniscale.tools.train.config import load_config, run_spec
    from omniscale.tools.train.launch import ensure_data
    from omniscale.tools.train.loop import device_of, rank_threads

    cfg, _ = load_config(config, list(sets))
    if cfg.task == "video_gen":
        raise UserError("balance calibrate: the video_gen task has no packed backbone to time")
    ensure_data(cfg)
    spec = run_spec(cfg, cfg.data.spec)
    device = device_of(cfg, 0)
    for flag, value in (("--nproc", nproc), ("--repeats", repeats), ("--held-out", held_out)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be >= 1")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(rank_threads(nproc))  # as each of the run's ranks
    started = time.perf_counter()
    try:
        result = _measure(cfg, spec, device, repeats, held_out, progress) | {
            "nproc": nproc, "threads": torch.get_num_threads()}
    finally:
        torch.set_num_threads(threads)
    if nproc > 1:
        progress(f"layout: micro-batches and the reshard on {nproc} sharded ranks")
        with_layout(result, measure_layout(config, list(sets), nproc, repeats))
    return result | {"elapsed_s": round(time.perf_counter() - started, 1)}


def with_layout(result: dict, layout: dict) -> None:
    """The run's layout's prices into the cost document (``calibrate_layout``): a micro-batch's
    fixed cost as the sharded run pays it (the one-process fit's is kept beside it), and the
    collectives' per-token prices -- the reshard's measured, the SP all-to-alls' derived from
    it (Ulysses moves q, k, v and the output, each ``d_model`` wide at most, per layer, and as
    many gradients back: 4 × layers times the reshard's rows per token; ``CommModel``)."""
    llm = result["llm"]
    llm["per_micro_batch_one_process"] = llm["per_micro_batch"]
    llm["per_micro_batch"] = max(layout["per_micro_batch"], llm["per_micro_batch"])
    llm["per_step"] = layout["per_step"]  # clip + AdamW: no plan changes it, a step pays it
    result["collectives"] = {"reshard_per_token": layout["reshard_per_token"],
                             "sp_comm_per_token": 4 * layout["layers"]
                             * layout["reshard_per_token"]}
    result["layout"] = layout


def _measure(cfg, spec, device, repeats: int, held_out: int, progress) -> dict:
    from omniscale.tools.train.build import build_model, model_config

    model = build_model(model_config(cfg, spec.media, spec.tokenizer), cfg.seed, device)
    budget = cfg.data.micro_batch_tokens
    grid, mixes = backbone_mixes(budget, np.random.default_rng(cfg.seed), held_out)
    grid_s, mixes_s = [], []
    _backbone_step(model, grid[-1], device)()  # warm-up: first calls allocate, initialise
    for i, lengths in enumerate(grid + mixes):
        (grid_s if i < len(grid) else mixes_s).append(
            _seconds(_backbone_step(model, lengths, device), device, repeats))
        progress(f"backbone {i + 1}/{len(grid) + len(mixes)}: {len(lengths)} sequences, "
                 f"{sum(lengths)} tokens")
    llm = backbone_fit(grid, grid_s, mixes, mixes_s)
    encoders = {}
    for kind, sizes in encoder_grids(model, spec.media).items():
        _encoder_step(model, kind, sizes[-1], device)()  # warm-up
        seconds = [_seconds(_encoder_step(model, kind, s, device), device, repeats)
                   for s in sizes]
        items = [int(np.prod(s)) for s in sizes]
        encoders[kind] = {**_model_fit(items, seconds), "sizes": items}
        progress(f"{kind} encoder: {len(sizes)} item sizes")
    return cost_document(llm, encoders, device=str(device), model=cfg.model.preset,
                         micro_batch_tokens=budget,
                         measured={"backbone_mixes": [[len(m), sum(m)] for m in grid],
                                   "backbone_seconds": grid_s})


def summary(result: dict) -> str:
    """The fit in a few lines: each model and how well it predicts."""
    llm, held = result["llm"], result["llm"]["held_out"]
    lines = [f"backbone: {llm['alpha']:.3e}·ΣL + {llm['beta']:.3e}·ΣL² + {llm['gamma']:.3e}·n "
             f"+ {llm['per_micro_batch']:.3e} seconds per micro-batch; fit R² {llm['r2']}, "
             f"MAPE {llm['mape']:.1%}; held-out "
             f"({held['mixes']} mixes) R² {held['r2']}, MAPE {held['mape']:.1%}"]
    for kind, e in result["encoders"].items():
        lines.append(f"{kind} encoder: {e['alpha']:.3e}·s + {e['beta']:.3e}·s² + "
                     f"{e['gamma']:.3e} seconds per item; R² {e['r2']}, MAPE {e['mape']:.1%}")
    return "\n".join(lines)
