"""``optim.groups`` without a training run (tools/train/optim_groups.py): AdamW's parameter
groups (which tensors decay, in which order, which are left out), the error lines of a group
that matches nothing or only what earlier groups took, and the line naming the group that froze
a parameter FSDP cannot separate. Expected values are written out by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omniscale.errors import UserError
from omniscale.parallel.fsdp import MixedUnitError
from omniscale.tools.train.config import ParamGroup
from omniscale.tools.train.optim_groups import Groups, param_groups, resolve, unit_error


class Named(nn.Module):
    """Parameters under the given dotted names, with the given shapes (plain names, as the
    omni model's)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.tree = nn.ModuleDict()
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            node = self.tree
            for part in path:
                if part not in node:
                    node[part] = nn.ModuleDict()
                node = node[part]
            node.register_parameter(leaf, nn.Parameter(torch.zeros(shape)))

    def named_parameters(self, *args, **kwargs):  # the plain names, without "tree."
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.removeprefix("tree."), p


def _names(model: nn.Module, group: dict) -> list[str]:
    ids = {id(p) for p in group["params"]}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def test_expert_weights_of_three_dimensions_decay_like_matrices():
    model = Named({"moe.experts.w_EDF": (4, 8, 16), "moe.router.weight": (4, 8),
                   "norm.weight": (8,)})
    groups, scales = param_groups(model, Groups(), weight_decay=0.1)
    assert [(_names(model, g), g["weight_decay"]) for g in groups] == [
        (["moe.experts.w_EDF", "moe.router.weight"], 0.1), (["norm.weight"], 0.0)]
    assert scales == [1.0, 1.0]


def test_a_parameter_that_needs_no_grad_is_left_out_and_the_ones_after_it_kept():
    model = Named({"a.weight": (2, 2), "b.weight": (2, 2), "c.bias": (2,)})
    dict(model.named_parameters())["a.weight"].requires_grad_(False)
    groups, _ = param_groups(model, Groups(), weight_decay=0.1)
    assert [_names(model, g) for g in groups] == [["b.weight"], ["c.bias"]]


def test_groups_come_by_scale_in_order_of_appearance_matrices_first_within_one():
    model = Named({"vision.bias": (4,), "vision.weight": (4, 4), "decoder.bias": (4,),
                   "decoder.weight": (4, 4)})
    groups = resolve([ParamGroup(match="vision.*", lr_scale=0.5)],
                     [n for n, _ in model.named_parameters()])
    out, scales = param_groups(model, groups, weight_decay=0.1)
    assert [(_names(model, g), g["weight_decay"]) for g in out] == [
        (["vision.weight"], 0.1), (["vision.bias"], 0.0),
        (["decoder.weight"], 0.1), (["decoder.bias"], 0.0)]
    assert scales == [0.5, 0.5, 1.0, 1.0]


NAMES = ["vision.blocks.0.qkv.weight", "vision.merger.fc1.weight", "decoder.layers.0.w"]


def test_a_group_matching_nothing_names_the_prefixes_and_the_first_name():
    with pytest.raises(UserError) as error:
        resolve([ParamGroup(match="encoders.vision.*", lr_scale=0.1)], NAMES)
    assert str(error.value) == (
        "optim.groups[0]: match 'encoders.vision.*' matches no parameter (names are plain "
        "module paths under: vision.*, decoder.*; e.g. vision.blocks.0.qkv.weight)")


def test_a_group_whose_matches_earlier_groups_took_names_the_first_ones_group():
    specs = [ParamGroup(match="vision.blocks.*", lr_scale=0.1),
             ParamGroup(match="vision.merger.*", lr_scale=0.5),
             ParamGroup(match="vision.*", frozen=True)]
    with pytest.raises(UserError) as error:
        resolve(specs, NAMES)
    assert str(error.value) == (
        "optim.groups[2]: every parameter match 'vision.*' matches is taken by an earlier "
        "group, first optim.groups[0] ('vision.blocks.*')")


def test_a_mixed_unit_under_a_pipeline_stage_names_the_group_of_the_whole_name():
    # under PP the stage's names lose their "decoder." prefix: the group is found by suffix
    model = Named({"decoder.layers.0.w": (2, 2), "decoder.layers.0.b": (2,)})
    groups = resolve([ParamGroup(match="decoder.layers.0.w", frozen=True)],
                     [n for n, _ in model.named_parameters()])
    error = MixedUnitError("layers.0", "layers.0", "layers.0.w", "layers.0.b")
    assert str(unit_error(groups, model, error)).startswith(
        "optim.groups[0] ('decoder.layers.0.w'): FSDP unit layers.0 would hold frozen "
        "layers.0.w")
