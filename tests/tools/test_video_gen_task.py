"""The ``video_gen`` task on real data: the tiny demo, planned by an embedded plane and loaded
by ``RankLoader`` exactly as the trainer does, turned into DiT inputs and trained."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml

from omniscale.backbone.dit import patchify_video
from omniscale.dataplane.embedded import start_embedded
from omniscale.dataplane.plane import PlaneConfig
from omniscale.dataplane.spec import load_spec
from omniscale.encoders.vision_input import IMAGE_MEAN, IMAGE_STD, vision_patches
from omniscale.errors import UserError
from omniscale.geometry import MediaGeometry
from omniscale.loaders.collate import collate
from omniscale.loaders.decode_text import load_tokenizer
from omniscale.loaders.pipeline import RankLoader
from omniscale.loaders.pixels import pixel_rows
from omniscale.tools.train.config import RunConfig
from omniscale.tools.train.plane_session import loader_for
from omniscale.tools.train.video_gen import (
    build_video_model,
    evaluate_video_gen,
    merge_to_raster,
    video_clips,
    video_gen_loss,
)
from tests.demo_data import copy_demo

STEPS = 8  # planned steps fetched (two micro-batches of <= 512 tokens each)


@pytest.fixture(scope="module")
def data(demo_root, tmp_path_factory):
    """(spec, micro-batches) of the tiny demo under a video-heavy mix, through the real
    plane and loader (one rank, as ``tools.train.loop`` builds them)."""
    root = copy_demo(demo_root, tmp_path_factory.mktemp("video_gen") / "demo")
    raw = yaml.safe_load((root / "mix.yaml").read_text())
    raw["schedule"] = {"unit": "steps", "segments": [
        {"kind": "const", "start": 0, "end": None,
         "weights": {"video_caption": 3, "image_caption": 1, "text": 1}}]}
    (root / "video.yaml").write_text(yaml.safe_dump(raw))
    spec = load_spec(root / "video.yaml")
    config = PlaneConfig(dp=1, micro_batch_tokens=512, window=2, global_batch_tokens=1024,
                         sp_max=1, snapshot_every=100)
    mbs = []
    with start_embedded(spec.path, root.parent / "plane", config) as plane, \
            loader_for(plane.url, 0, RankLoader, {s.name: s.path for s in spec.sources},
                       spec.tokenizer, spec.media, num_workers=0) as loader:
        for step in range(STEPS):
            mbs += next(loader).micro_batches
            loader.commit(step)
    return spec, mbs


def _with_video(mbs):
    return [mb for mb in mbs if (mb.vision_kind_V == 1).any()]


def _model(spec, seed=0):
    return build_video_model(RunConfig(seed=seed), spec, torch.device("cpu"))


def test_merge_window_patches_reorder_to_dit_patches():
    """The loaders' (merge-window) patches of a clip, reordered, are the DiT's own."""
    g = MediaGeometry(patch_size=8, merge_size=2, temporal_patch_size=2)
    frames = np.random.default_rng(0).integers(0, 256, (4, 32, 48, 3), dtype=np.uint8)
    rows, grid = pixel_rows(frames, g, video=True)
    vision_PD = vision_patches(torch.from_numpy(rows), torch.tensor([grid]),
                               torch.tensor([len(rows)]), 2)
    mean, std = torch.tensor(IMAGE_MEAN), torch.tensor(IMAGE_STD)
    normalised = (torch.from_numpy(frames).float() / 255.0 - mean) / std
    dit_PC, dit_grid = patchify_video(normalised, 8, 2)
    assert grid == dit_grid == (2, 4, 6)
    torch.testing.assert_close(merge_to_raster(vision_PD, grid, 2), dit_PC, rtol=0, atol=0)


def test_clips_and_captions_of_real_batches(data):
    spec, mbs = data
    tok = load_tokenizer(spec.tokenizer)
    kinds = set()
    for mb in mbs:
        kinds |= set(mb.vision_kind_V.tolist())
        clips = video_clips(mb, patch_dim=3 * 2 * 8 * 8)
        is_video = mb.vision_kind_V == 1
        if not is_video.any():
            assert clips is None
            continue
        grids = mb.vision_grid_thw_V3[is_video]
        assert torch.equal(clips.grid_thw_V3, grids)
        assert clips.x0_PC.shape == (int(grids.prod(dim=1).sum()), 384)
        assert torch.isfinite(clips.x0_PC).all()
        ends = clips.caption_offsets_V.tolist()[1:] + [len(clips.caption_ids_W)]
        for a, b in zip(clips.caption_offsets_V.tolist(), ends):
            ids = clips.caption_ids_W[a:b]
            assert not set(ids.tolist()) & set(tok.marker_ids.values())  # text only
            text = tok.tokenizer.decode(ids.tolist())
            assert " moves " in text, text  # the demo's "a red circle moves left."
    assert kinds == {0, 1}  # images are in the batches too, and left out of the clips


def test_loss_is_finite_positive_and_seeded(data):
    spec, mbs = data
    model = _model(spec)
    for mb in _with_video(mbs)[:2]:
        out = video_gen_loss(model, mb, torch.Generator().manual_seed(7))
        n = int(out["n_targets"])
        assert n == int(mb.vision_grid_thw_V3[mb.vision_kind_V == 1].prod(dim=1).sum())
        mean = float(out["loss_sum"].detach()) / n
        assert math.isfinite(mean) and mean > 0 and out["aux"] == {}
        again = video_gen_loss(model, mb, torch.Generator().manual_seed(7))
        assert torch.equal(again["loss_sum"], out["loss_sum"])
        other = video_gen_loss(model, mb, torch.Generator().manual_seed(8))
        assert not torch.equal(other["loss_sum"], out["loss_sum"])


def test_batch_without_video_is_a_zero_loss_touching_every_parameter(data):
    spec, mbs = data
    no_video = [mb for mb in mbs if not (mb.vision_kind_V == 1).any()]
    assert no_video, "the mix should plan some micro-batches without video"
    empty = collate([], spec.media)  # a padded (empty) micro-batch slot
    model = _model(spec)
    for mb in (no_video[0], empty):
        model.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(3)
        state = gen.get_state()
        out = video_gen_loss(model, mb, gen)
        assert int(out["n_targets"]) == 0 and float(out["loss_sum"].detach()) == 0.0
        out["loss_sum"].backward()
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            assert not p.grad.any(), name
        assert torch.equal(gen.get_state(), state)  # no random numbers drawn
    held = evaluate_video_gen(model, no_video[:1])  # dummy forwards only
    assert held["n_targets"] == 0 and math.isnan(held["loss"])


def test_build_video_model(data):
    spec, _ = data
    a, b = _model(spec, seed=5), _model(spec, seed=5)
    c = a.config
    assert (c.patch_size, c.temporal_patch_size) == (spec.media.patch_size,
                                                     spec.media.temporal_patch_size)
    vocab = load_tokenizer(spec.tokenizer).tokenizer.get_vocab_size(with_added_tokens=True)
    assert c.vocab_size >= vocab and c.vocab_size % 64 == 0
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert RunConfig().model.dit == "tiny"
    with pytest.raises(UserError, match="^model.dit: unknown DiT preset 'huge'"):
        build_video_model(RunConfig(model={"dit": "huge"}), spec, torch.device("cpu"))


@pytest.mark.slow  # 24 AdamW steps + 10 evaluations of the tiny DiT: ~25 s of CPU on 2 cores
def test_training_lowers_held_out_loss(data):
    """A few dozen AdamW steps on real batches; the held-out loss at fixed times and noise
    (evaluate_video_gen) falls clearly: mean of the last 5 evaluations vs the first 5."""
    spec, mbs = data
    torch.manual_seed(0)
    videos = _with_video(mbs)
    held_out, train = videos[2:4], videos[:2] + videos[4:]  # held out: two mid-size ones
    assert len(train) >= 4
    model = _model(spec)
    first = evaluate_video_gen(model, held_out)
    assert first == evaluate_video_gen(model, held_out)  # deterministic
    assert first["n_targets"] == 3 * sum(video_clips(mb).x0_PC.shape[0] for mb in held_out)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    steps, evals = 24, {}
    for step in range(steps):
        if step < 5 or step >= steps - 5:  # the loss of step s: before its update
            evals[step] = evaluate_video_gen(model, held_out)["loss"] if step else first["loss"]
        out = video_gen_loss(model, train[step % len(train)], gen)
        opt.zero_grad(set_to_none=True)
        (out["loss_sum"] / out["n_targets"]).backward()
        opt.step()
    early = sum(evals[s] for s in range(5)) / 5
    late = sum(evals[s] for s in range(steps - 5, steps)) / 5
    print(f"held-out velocity loss: before {first['loss']:.3f}, first-5 mean {early:.3f}, "
          f"last-5 mean {late:.3f}")
    assert all(math.isfinite(v) for v in evals.values())
    assert late < 0.8 * early and late < 0.7 * first["loss"]
