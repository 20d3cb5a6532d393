"""``optim.groups``: per-module learning-rate scales and freezing.

Each parameter is matched by its plain name, as the model's ``named_parameters()`` gives it
before any parallelism (``vision.blocks.0.qkv.weight``, ``decoder.layers.3.ffn.router.weight``),
against the groups' ``fnmatch`` globs in order: the first match decides, and a parameter no
group matches trains at scale 1.

* Frozen parameters get ``requires_grad=False`` before the model is parallelized, so FSDP
  builds its units knowing them (``parallel.fsdp``: a unit is all frozen or all trained), and
  they receive no gradient. They are not given to the optimizer at all: no optimizer state, in
  memory or in checkpoints, and their values stay bit-identical.
* ``lr_scale`` multiplies the scheduled learning rate every step: the optimizer's parameter
  groups are (scale, decay) pairs (matrices decay, vectors do not) and ``step.set_lr`` sets
  each to ``lr_at(step)`` times its scale. The scales are kept beside the optimizer
  (``optimizer.lr_scales``), not in its param groups: a checkpoint restores param groups as
  saved, and on resume the run config's scales must hold.
* A tower whose blocks (and what feeds them) are frozen runs forward only; the plane prices
  its items so (``Groups.frozen_kinds``, ``balancer.cost.Costs.forward_only``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from omniscale.errors import UserError
from omniscale.media import MEDIA_KINDS
from omniscale.parallel.dcp import plain_name

# The encoder kinds each tower encodes, and the modules after its blocks: a trained projector
# behind frozen blocks adds only its own small backward (nothing flows back into the blocks).
TOWER_KINDS = {"vision": ("image", "video"), "audio": ("audio",)}
TOWER_TAILS = {"vision": ("merger",), "audio": ("norm", "projector")}


@dataclass(frozen=True)
class Groups:
    """The run's ``optim.groups`` (``config.ParamGroup``s) and what they decide per name."""

    specs: tuple = ()
    # encoder kinds (MEDIA_KINDS order) whose tower runs forward only; known once
    # ``resolve`` has seen the model's names
    frozen_kinds: tuple[str, ...] = field(default=())

    def index(self, name: str) -> int | None:
        """The first group whose glob matches ``name`` (a plain name), or None."""
        return next((i for i, g in enumerate(self.specs)
                     if fnmatch.fnmatchcase(name, g.match)), None)

    def frozen(self, name: str) -> bool:
        i = self.index(name)
        return i is not None and self.specs[i].frozen

    def scale(self, name: str) -> float:
        i = self.index(name)
        return 1.0 if i is None else self.specs[i].scale

    def describe(self, name: str) -> str:
        """``optim.groups[i] ('glob')`` of the group deciding ``name`` (for error lines)."""
        i = self.index(name)
        return "no group" if i is None else f"optim.groups[{i}] ({self.specs[i].match!r})"


def resolve(specs, names: list[str]) -> Groups:
    """The groups checked against the model's plain parameter ``names``: a one-line UserError
    for a group that matches nothing (naming the top-level prefixes that exist: the issue's
    ``encoders.vision.*`` is ``vision.*`` here), for one every match of which an earlier group
    takes, and when nothing is left to train."""
    groups = Groups(tuple(specs))
    won = [groups.index(n) for n in names]
    for i, spec in enumerate(groups.specs):
        if i in won:
            continue
        matched = [n for n in names if fnmatch.fnmatchcase(n, spec.match)]
        if not matched:
            prefixes = ", ".join(dict.fromkeys(n.split(".")[0] + ".*" for n in names))
            raise UserError(f"optim.groups[{i}]: match {spec.match!r} matches no parameter "
                            f"(names are plain module paths under: {prefixes}; e.g. "
                            f"{names[0]})")
        raise UserError(f"optim.groups[{i}]: every parameter match {spec.match!r} matches is "
                        f"taken by an earlier group, first {groups.describe(matched[0])}")
    if names and all(groups.frozen(n) for n in names):
        raise UserError("optim.groups: every parameter is frozen (nothing to train)")
    return Groups(groups.specs, frozen_kinds(groups, names))


def frozen_kinds(groups: Groups, names: list[str]) -> tuple[str, ...]:
    """Encoder kinds whose tower's blocks and inputs are all frozen (its tail may train)."""
    kinds: set[str] = set()
    for tower, tower_kinds in TOWER_KINDS.items():
        heavy = [n for n in names if n.startswith(tower + ".")
                 and n.split(".")[1] not in TOWER_TAILS[tower]]
        if heavy and all(groups.frozen(n) for n in heavy):
            kinds.update(tower_kinds)
    return tuple(k for k in MEDIA_KINDS if k in kinds)


def model_names(cfg, spec, mcfg) -> list[str]:
    """The plain parameter names of the run's model, from a copy built on the meta device
    (no memory, no initialisation): ``mcfg`` None is the video_gen task's DiT."""
    with torch.device("meta"):
        if mcfg is None:
            from omniscale.backbone.dit import VideoDiT
            from omniscale.tools.train.video_gen import dit_config

            model = VideoDiT(dit_config(cfg, spec))
        else:
            from omniscale.backbone.omni import OmniModel

            model = OmniModel(mcfg)
    return [name for name, _ in model.named_parameters()]


def check(cfg, spec, mcfg) -> Groups:
    """The run's groups, checked against its model (``loop.layout``: before any process
    starts, and on every rank before the plane starts)."""
    if not cfg.optim.groups:
        return Groups()
    return resolve(cfg.optim.groups, model_names(cfg, spec, mcfg))


def freeze(model: torch.nn.Module, groups: Groups) -> None:
    """``requires_grad=False`` on the frozen parameters: before parallelization."""
    for name, p in model.named_parameters():
        if groups.frozen(plain_name(name)):
            p.requires_grad_(False)


def unit_error(groups: Groups, model: torch.nn.Module, error) -> UserError:
    """``parallel.fsdp.MixedUnitError`` as one line naming the group that froze the parameter
    (its name there is relative to what FSDP wrapped: under PP, the decoder's stage)."""
    names = [plain_name(n) for n, _ in model.named_parameters()]
    name = next((n for n in names if n == error.frozen or n.endswith("." + error.frozen)),
                error.frozen)
    return UserError(f"{groups.describe(name)}: {error}")


def param_groups(model: torch.nn.Module, groups: Groups, weight_decay: float
                 ) -> tuple[list[dict], list[float]]:
    """AdamW's parameter groups, one per (scale, decay) pair with parameters (matrices decay,
    vectors -- norms, biases -- do not), and each group's lr scale. Without ``optim.groups``:
    the matrices, then the vectors, as before groups existed."""
    by_key: dict[tuple[float, bool], list] = {}
    for name, p in model.named_parameters():
        name = plain_name(name)
        if groups.frozen(name):
            if p.requires_grad:  # a parallel/ apply_* that re-created it lost the flag
                raise RuntimeError(f"{name}: frozen by {groups.describe(name)} but requires "
                                   "grad after parallelization")
            continue
        if not p.requires_grad:
            continue
        by_key.setdefault((groups.scale(name), p.ndim >= 2), []).append(p)
    if not by_key:
        raise UserError("optim.groups: every parameter this rank holds is frozen (a pipeline "
                        "stage with nothing to train)")
    # scales in the order they first appear, matrices before vectors (as before groups
    # existed); no empty group: DCP's optimizer state dict names a group by its first parameter
    scales = list(dict.fromkeys(scale for scale, _ in by_key))
    keys = sorted(by_key, key=lambda k: (scales.index(k[0]), not k[1]))
    return ([{"params": by_key[k], "weight_decay": weight_decay if k[1] else 0.0}
             for k in keys], [k[0] for k in keys])
