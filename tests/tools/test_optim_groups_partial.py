"""A tower PARTLY frozen by ``optim.groups`` (issue #46, item 5): one block of the vision tower
frozen by a glob, the projector at its own scale, the rest of the tower at the tower's scale
and the decoder at 1. After AdamW's first step the frozen block is bit-identical and has no
optimizer state, and every other parameter moved by the learning rate of the group that
matched it FIRST; the tower still counts as trained for the plane's costs (its blocks are not
all frozen), unlike a tower whose blocks are all frozen.

The oracle: AdamW's first step with weight decay off moves each element by lr·g/(|g|+eps),
lr·sign(g) to within 1e-4 for these gradients (the bias-corrected moments are g and g²)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omniscale.tools.train.build import build_optimizer
from omniscale.tools.train.config import load_config
from omniscale.tools.train.optim_groups import Groups, freeze, resolve
from omniscale.tools.train.step import set_lr

LR = 0.01
GROUPS = ('[{match: "vision.blocks.0.*", frozen: true}, '
          '{match: "vision.merger.*", lr_scale: 0.5}, {match: "vision.*", lr_scale: 0.1}]')


def _block() -> nn.Module:
    return nn.ModuleDict({"qkv": nn.Linear(4, 12), "attn_norm": nn.LayerNorm(4)})


def _model() -> nn.Module:
    """The omni model's shape of names: ``vision.{patch_embed,blocks.N,merger}``, a decoder."""
    torch.manual_seed(0)
    vision = nn.ModuleDict({"patch_embed": nn.Linear(6, 4),
                            "blocks": nn.ModuleList([_block(), _block()]),
                            "merger": nn.ModuleDict({"fc1": nn.Linear(4, 4)})})
    return nn.ModuleDict({"vision": vision, "decoder": nn.Linear(4, 3)})


def _expected_scale(name: str) -> float | None:
    """By hand from GROUPS (None: frozen)."""
    if name.startswith("vision.blocks.0."):
        return None
    if name.startswith("vision.merger."):
        return 0.5
    return 0.1 if name.startswith("vision.") else 1.0


def _cfg(groups: str):
    cfg, _ = load_config(None, ["optim.weight_decay=0", "optim.warmup_steps=0",
                                f"optim.lr={LR}", "optim.min_lr=0", f"optim.groups={groups}"])
    return cfg


def test_a_partly_frozen_tower_trains_the_rest_at_its_groups_lr():
    cfg = _cfg(GROUPS)
    model = _model()
    freeze(model, Groups(tuple(cfg.optim.groups)))  # as the trainer does, before the optimizer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, cfg)
    set_lr(optimizer, 0, cfg)
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p) + 0.5 * torch.randn_like(p).sign()  # |g| not tiny
    optimizer.step()
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    frozen_names = []
    for name, p in model.named_parameters():
        scale = _expected_scale(name)
        if scale is None:
            frozen_names.append(name)
            assert not p.requires_grad and id(p) not in held and p not in optimizer.state
            assert torch.equal(p.detach(), before[name]), name
            continue
        moved = (p.detach() - before[name]).abs()
        torch.testing.assert_close(moved, torch.full_like(moved, LR * scale), rtol=1e-4,
                                   atol=0, msg=name)
    assert frozen_names == ["vision.blocks.0.qkv.weight", "vision.blocks.0.qkv.bias",
                            "vision.blocks.0.attn_norm.weight", "vision.blocks.0.attn_norm.bias"]
    assert len(optimizer.state) == len(before) - len(frozen_names)


@pytest.mark.parametrize("groups, kinds", [
    (GROUPS, ()),  # block 1 and the patch embedding train: the tower runs backward
    ('[{match: "vision.merger.*", lr_scale: 0.5}, {match: "vision.*", frozen: true}]',
     ("image", "video")),  # only its projector trains: forward only
])
def test_only_a_tower_whose_blocks_are_all_frozen_is_priced_forward_only(groups, kinds):
    names = [n for n, _ in _model().named_parameters()]
    assert resolve(_cfg(groups).optim.groups, names).frozen_kinds == kinds
