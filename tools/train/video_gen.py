"""The ``video_gen`` task: a rectified-flow video DiT (``backbone.dit``, Goku-style) trained on
the same data path as the omni task.

The plane plans the steps and ``loaders.pipeline.RankLoader`` yields the usual
``PackedBatch`` micro-batches; this module turns each one into the DiT's inputs:

- **clips**: the micro-batch's *video* items (``vision_kind_V == VIDEO``). Their patches are the
  vision encoder's (``encoders.vision_input.vision_patches``: CLIP-normalised pixels, a patch vector
  laid out (channel, frame, row, col), patches in Qwen2-VL *merge-window* order). The DiT is
  built with the same patch and temporal patch size as the spec's ``media:`` geometry, so a
  patch vector is already a DiT patch vector (``backbone.dit.patchify_video`` uses the same
  (C, tp, p, p) layout); only the patch *order* differs, and :func:`merge_to_raster` reorders
  it to the raster (t, h, w) order the DiT's 3-D RoPE expects. The merge size is read off the
  batch itself (a block of ``t*h*w / merge**2`` LLM tokens), so no geometry travels with it.
- **captions**: the text tokens (every token outside a media block, ``<eos>`` included) of the
  sequence that holds the clip (``media_sample_M``, ``cu_seqlens_S1``, ``input_ids_T``).

Images are skipped. The decoders already give an image as a 2-frame repeated clip of grid
``(1, h, w)``, so they *could* join as still clips, but (a) in the omni mixes the images
outnumber the clips and are up to 4x larger (``max_pixels`` vs ``video_max_pixels``), so they
would silently turn the task's patch-weighted objective into a mostly-image one the mixing
spec never asked for; (b) the task, its metrics and its eval are "video velocity loss", and a
micro-batch without video then has ``n_targets == 0`` — what the mixture's video sources
supply is exactly what the DiT trains on. Joint image-video training (Goku's) is a later,
explicit choice: a mixing spec that wants it should say so.

Every rank runs every module (FSDP's collectives must line up): a micro-batch with no video
still runs one forward over a dummy 1-patch clip and returns ``0 * loss``, so every parameter
receives a (zero) gradient.

Legend: T tokens, S sequences, P patches, D/C patch values, V clips, W caption tokens,
M media items.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from omniscale.backbone.dit import DiTConfig, VideoDiT
from omniscale.dataplane.spec import MixSpec
from omniscale.encoders.vision_input import vision_patches
from omniscale.errors import UserError
from omniscale.loaders.collate import PackedBatch
from omniscale.loaders.decode_text import tokenizer_size
from omniscale.media import MEDIA_KINDS
from omniscale.tools.train.config import RunConfig

VIDEO = MEDIA_KINDS.index("video")  # vision_kind_V / media_kind_M id of a video
EVAL_TIMES = (0.25, 0.5, 0.75)  # evaluate_video_gen's fixed flow times
EVAL_SEED = 1234  # noise of held-out batch i: torch.Generator().manual_seed(EVAL_SEED + i)


@dataclass
class Clips:
    """The DiT inputs of one micro-batch's video items (see VideoDiT.forward)."""

    x0_PC: torch.Tensor  # float32 [P, C]: clean patches, raster (t, h, w) order per clip
    grid_thw_V3: torch.Tensor  # int64 [V, 3]
    caption_ids_W: torch.Tensor  # int64 [W]: captions packed
    caption_offsets_V: torch.Tensor  # int64 [V]: where clip v's caption starts in W

    def to(self, device: torch.device) -> "Clips":
        return Clips(*(t.to(device) for t in (self.x0_PC, self.grid_thw_V3, self.caption_ids_W,
                                              self.caption_offsets_V)))


def dit_config(cfg: RunConfig, spec: MixSpec) -> DiTConfig:
    """``cfg.model.dit``'s preset on the spec's patch geometry, with a caption vocabulary
    holding every id of the spec's tokenizer (rounded up to 64, as the omni model's)."""
    g = spec.media
    vocab = tokenizer_size(spec.tokenizer)
    try:
        return DiTConfig.preset(cfg.model.dit, in_channels=3, patch_size=g.patch_size,
                                temporal_patch_size=g.temporal_patch_size,
                                vocab_size=-(-vocab // 64) * 64)
    except ValueError as e:
        raise UserError(f"model.dit: {e}") from None


def build_video_model(cfg: RunConfig, spec: MixSpec, device: torch.device) -> VideoDiT:
    """The DiT of the run, built identically on every rank (seeded by ``cfg.seed``)."""
    config = dit_config(cfg, spec)
    torch.manual_seed(cfg.seed)
    return VideoDiT(config).to(device)


def merge_to_raster(patches_PD: torch.Tensor, grid_thw: tuple[int, int, int], merge: int
                    ) -> torch.Tensor:
    """One item's patches from merge-window order (t, h/m, w/m, m, m) to raster (t, h, w)."""
    t, h, w = grid_thw
    if merge == 1:
        return patches_PD
    x = patches_PD.reshape(t, h // merge, w // merge, merge, merge, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(t * h * w, -1)


def video_clips(mb: PackedBatch, patch_dim: int | None = None) -> Clips | None:
    """The micro-batch's video items as DiT inputs, or None when it holds no video."""
    kinds = mb.media_kind_M.tolist()
    vision_rows = [(m, int(mb.media_index_M[m])) for m, k in enumerate(kinds) if k != 2]
    grids = [tuple(g) for g in mb.vision_grid_thw_V3.tolist()]
    rows_V = mb.vision_rows_V.tolist()
    starts = [0, *itertools.accumulate(rows_V)]
    videos = [(m, v) for m, v in vision_rows if int(mb.vision_kind_V[v]) == VIDEO]
    if not videos:
        return None
    temporal = rows_V[videos[0][1]] // math.prod(grids[videos[0][1]])
    width = mb.pixel_rows_RQ.shape[1] * temporal
    if patch_dim is not None and width != patch_dim:
        raise ValueError(f"vision patches are {width} wide but the DiT's patches are "
                         f"{patch_dim}: its patch geometry must equal the spec's media")
    # Text = every token outside a media block (blocks may overhang a slice's ends).
    T = mb.num_tokens
    is_text_T = torch.ones(T, dtype=torch.bool)
    for start, n in zip(mb.media_token_start_M.tolist(), mb.media_num_tokens_M.tolist()):
        is_text_T[max(start, 0):min(start + n, T)] = False
    cu = mb.cu_seqlens_S1.tolist()
    patches, out_grids, captions, offsets, at = [], [], [], [], 0
    for m, v in videos:
        t, h, w = grids[v]
        merge = math.isqrt(t * h * w // int(mb.media_num_tokens_M[m]))
        rows = mb.pixel_rows_RQ[starts[v]:starts[v + 1]]
        patches_PD = vision_patches(rows, torch.tensor([grids[v]]), torch.tensor([len(rows)]),
                                    temporal)
        patches.append(merge_to_raster(patches_PD, grids[v], merge))
        out_grids.append(grids[v])
        s = int(mb.media_sample_M[m])
        ids = mb.input_ids_T[cu[s]:cu[s + 1]][is_text_T[cu[s]:cu[s + 1]]]
        captions.append(ids)
        offsets.append(at)
        at += len(ids)
    return Clips(torch.cat(patches), torch.tensor(out_grids, dtype=torch.int64),
                 torch.cat(captions).to(torch.int64), torch.tensor(offsets, dtype=torch.int64))


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _dummy_forward(model: VideoDiT, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Velocity and router loss of one zero 1-patch clip at t = 1/2 with a 1-token caption:
    every parameter is on its graph, and no random numbers are drawn."""
    c = model.config
    v_PC, router = model.velocity(torch.zeros(1, c.patch_dim, device=device),
                                  torch.full((1,), 0.5, device=device),
                                  torch.ones(1, 3, dtype=torch.int64, device=device),
                                  torch.zeros(1, dtype=torch.int64, device=device),
                                  torch.zeros(1, dtype=torch.int64, device=device))
    return v_PC, router


def video_gen_loss(model: VideoDiT, mb: PackedBatch, generator: torch.Generator) -> dict:
    """Rectified-flow loss of one micro-batch's clips.

    ``loss_sum``: per-patch velocity MSE (mean over a patch's values) summed over the patches;
    ``n_targets``: the patches (int64; 0 without video). The caller divides by the global
    ``n_targets`` (all ranks, all micro-batches), so the update does not depend on how the
    clips were split. Time and noise come from ``generator`` (may live on another device than
    the model: draws are made on the generator's device). ``aux``: ``{}`` for a dense DiT;
    with ``DiTConfig.moe`` it holds ``router_loss`` (a per-patch mean: add
    ``router_loss * n_targets`` to ``loss_sum``, as the omni loop does)."""
    device = _device(model)
    clips = video_clips(mb, model.config.patch_dim)
    if clips is None:
        v_PC, router = _dummy_forward(model, device)
        zero = v_PC.float().sum() * 0.0 + router * 0.0
        out = {"loss_sum": zero, "n_targets": torch.zeros((), dtype=torch.int64, device=device),
               "aux": {}}
        if model.config.moe is not None:
            out["aux"]["router_loss"] = router * 0.0
        return out
    clips = clips.to(device)
    res = model(clips.x0_PC, clips.grid_thw_V3, clips.caption_ids_W, clips.caption_offsets_V,
                generator=generator)
    out = {"loss_sum": res["loss_sum"], "n_targets": res["n_tokens"].to(torch.int64),
           "aux": {}}
    if model.config.moe is not None:
        out["aux"]["router_loss"] = res["router_loss"]
    return out


@torch.no_grad()
def evaluate_video_gen(model: VideoDiT, batches, times=EVAL_TIMES, seed: int = EVAL_SEED,
                       indices: list[int] | None = None) -> dict:
    """:func:`velocity_result` of :func:`velocity_sums`."""
    return velocity_result(*velocity_sums(model, batches, times, seed, indices), times)


def velocity_sums(model: VideoDiT, batches, times=EVAL_TIMES, seed: int = EVAL_SEED,
                  indices: list[int] | None = None) -> tuple[list[float], int]:
    """Held-out velocity loss at fixed flow times, deterministic: (per time, the per-patch
    velocity MSE summed over patches; patches) -- sums, so ranks' slices add up.

    Batch ``i``'s noise comes from a CPU ``torch.Generator`` seeded ``seed + i`` (the same
    noise at every time), so the result depends only on the weights and the batches.
    Every batch runs ``len(times)`` forwards, dummy ones when it holds no video, so ranks
    handed the same number of batches run the same collectives under FSDP. ``indices``: each
    batch's index in the whole eval set (a rank's slice of it), for its noise seed.
    """
    device = _device(model)
    sums = {t: 0.0 for t in times}
    n = 0
    for i, mb in enumerate(batches):
        clips = video_clips(mb, model.config.patch_dim)
        if clips is None:
            for _ in times:
                _dummy_forward(model, device)
            continue
        gen = torch.Generator().manual_seed(seed + (indices[i] if indices is not None else i))
        noise_PC = torch.randn(clips.x0_PC.shape, generator=gen).to(device)
        clips = clips.to(device)
        x0_PC, n_clips = clips.x0_PC, clips.grid_thw_V3.shape[0]
        for t in times:
            x_t_PC = (1 - t) * x0_PC + t * noise_PC
            v_PC, _ = model.velocity(x_t_PC, torch.full((n_clips,), t, device=device),
                                     clips.grid_thw_V3, clips.caption_ids_W,
                                     clips.caption_offsets_V)
            sums[t] += float((v_PC.float() - (noise_PC - x0_PC)).pow(2).mean(dim=1).sum())
        n += x0_PC.shape[0]
    return [sums[t] for t in times], n


def velocity_result(sums: list[float], n: float, times=EVAL_TIMES) -> dict:
    """``loss`` (mean per-patch velocity MSE over all times), ``loss_t{t}`` per time, and
    ``loss_sum`` / ``n_targets`` (summed over times)."""
    total = sum(sums)
    out = {"loss": total / (n * len(times)) if n else float("nan"),
           "loss_sum": total, "n_targets": n * len(times)}
    for t, s in zip(times, sums, strict=True):
        out[f"loss_t{t:g}"] = s / n if n else float("nan")
    return out


def video_gen_step(env, state, step: int, model: VideoDiT, optimizer, batch):
    """One optimizer step of the video_gen task (``env``: ``step.StepEnv``, ``state``:
    ``step.RunState``): every micro-batch's clips, loss divided by the global patch count (all
    ranks), clip, AdamW; a ``records.StepRecord`` back. Time and noise come from a generator
    seeded by (seed, step, rank): a resumed run draws what the uninterrupted one drew."""
    from omniscale.tools.train import collectives
    from omniscale.tools.train.guard import guarded_update
    from omniscale.tools.train.records import step_record
    from omniscale.tools.train.step import placeholder, set_lr

    cfg = env.cfg
    state.clock.start()
    lr = set_lr(optimizer, step, cfg)
    optimizer.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(
        (cfg.seed * 1_000_003 + step) * 1_009 + env.rank)
    mbs = [mb if mb.num_tokens else placeholder(mb) for mb in batch.micro_batches]
    n_local = sum(int(mb.vision_grid_thw_V3[mb.vision_kind_V == VIDEO].prod(dim=1).sum())
                  for mb in mbs)
    counts = torch.tensor([n_local], dtype=torch.float64, device=env.device)
    collectives.sum_step_counts(counts, env.group)
    n_global = counts[0].clamp_min(1.0)
    loss_sum = torch.zeros(1, dtype=torch.float64, device=env.device)
    for mb in mbs:
        out = video_gen_loss(model, mb, generator)
        out["loss_sum"] = env.faults.on_loss(step, out["loss_sum"])
        loss = out["loss_sum"]
        if "router_loss" in out["aux"]:
            loss = loss + out["aux"]["router_loss"] * out["n_targets"]
        (loss / n_global).backward()
        loss_sum += out["loss_sum"].detach().double()
    grad_norm = collectives.clip_grad_norm(model, cfg.optim.grad_clip)
    skipped = guarded_update(state.guard, optimizer, loss_sum, counts[0], grad_norm,
                             contributes=env.tp_rank == 0)
    wall_s, compute_s = state.clock.stop()
    return step_record(step, batch, lr=lr, grad_norm=grad_norm, counts=counts,
                       sums=loss_sum, row=_video_row, wall_s=wall_s, compute_s=compute_s,
                       update_skipped=skipped)


def _video_row(record, sums: torch.Tensor, counts: torch.Tensor, times: dict,
               skipped: int) -> dict:
    patches = float(counts[0])
    return {"step": record.step, "loss": float(sums[0]) / max(patches, 1.0), "lr": record.lr,
            "tokens": int(patches), "tokens_per_s": patches / max(times["step_s"], 1e-9),
            **times, "micro_batches": record.micro_batches, "skipped": skipped}
