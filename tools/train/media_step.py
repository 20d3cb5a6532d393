"""Step 1 of an omni training step: encode this rank's encoder-plan items, reshard the
embeddings to the ranks whose sequences hold their placeholders, and give every micro-batch
its blocks (DESIGN.md "Data flow": encoders → reshard → backbone).

The plane's plan says which rank encodes each media item (its encode rows, the encoder plan,
balanced on its own, with the ranks consuming it) and which rank decodes it (its LLM rows,
with the rank encoding each item); each rank derives its side of the exchange from its own
plan (``batch.plan``, an ``omniscale.plan.RankPlan``:
``parallel.reshard.local_reshard_plan``), so nothing is gathered across ranks.

Items the plan does not cover are encoded locally in the same encoder call: the media of a
replacement sample (the planned one was corrupt: ``loaders.assemble``) and everything when the
plan carries no encoder rows. A planned item that its encoding rank dropped (it found the
sample corrupt while this rank did not, e.g. a decode timeout on one side only) arrives with
zero rows: the sequence holding it is not trained this step (its labels are ignored) and a
warning names it.

Backward runs in fixed phases so every rank issues its collectives in the same order, however
its micro-batches and media differ: (1) each micro-batch's decoder backward (FSDP over the
backbone), accumulating into detached leaves that stand for the received blocks; (2) one
backward through the reshard's all-to-all; (3) the vision encoder; (4) the audio encoder —
each encoder once, on its real items or its dummy input with a zero gradient.

Shape suffixes: N embedding rows, D LLM width, P patches, C patch values, R mel frames,
B mel bins.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from omniscale.kernels.transfer import HOST
from omniscale.layout import IGNORE_INDEX
from omniscale.loaders.collate import PackedBatch, media_items
from omniscale.media import AUDIO, kind_id
from omniscale.parallel.reshard import Resharded, local_reshard_plan
from omniscale.plan import ItemKey, item_key
from omniscale.tools.train import collectives


@dataclass
class _Inputs:
    """The items one rank encodes this step, per encoder, in call order."""

    vision_keys: list[ItemKey]
    pixel_rows: list[torch.Tensor]  # uint8 [rows, Q] per item (loaders.pixels)
    grids: list[tuple[int, int, int]]
    audio_keys: list[ItemKey]
    mels: list[torch.Tensor]
    frames: list[int]

    seen: set = dataclasses.field(default_factory=set)  # each item encoded once

    def add(self, key: ItemKey, tensor: torch.Tensor, grid, frames) -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        if key[3] == AUDIO:
            self.audio_keys.append(key), self.mels.append(tensor), self.frames.append(frames)
        else:
            self.vision_keys.append(key), self.pixel_rows.append(tensor)
            self.grids.append(tuple(grid))


def _batch_items(mb: PackedBatch):
    """(key, tensor, grid, frames) of every media item of a micro-batch, in media order
    (tensor None: not decoded here)."""
    for seq, kind, index, tensor, grid, frames in media_items(mb):
        yield item_key(mb.seq_refs[seq], kind, index), tensor, grid, frames


def _step_inputs(batch, received_keys: set) -> _Inputs:
    """What this rank encodes: its encoder plan's items, then every item of its own
    micro-batches that no other rank sends (replacements, or a plan without encoder rows)."""
    inputs = _Inputs([], [], [], [], [], [])
    for item in batch.encode_items:  # the plan's encode rows (the producer side)
        inputs.add(item_key(item.ref, kind_id(item.kind), item.index), item.tensor,
                   item.grid_thw, item.frames)
    for mb in batch.micro_batches:
        if mb.seq_refs is None:
            continue
        for key, tensor, grid, frames in _batch_items(mb):
            if key in received_keys:
                continue
            if tensor is None:
                raise RuntimeError(f"media item {key}: neither decoded on this rank nor sent "
                                   "to it by the plan's reshard (loader and plan disagree)")
            inputs.add(key, tensor, grid, frames)
    return inputs


def encode_and_reshard(model, batch, rank: int, world: int, group=None,
                       copies: int = 1) -> "StepMedia":
    """Forward of the step's media: this rank's encoder calls, then the reshard's all-to-all
    (a collective: every data rank of ``group`` calls it). ``rank`` of ``world`` data ranks;
    ``copies``: how many processes encode these same items (TP peers with the encoders
    replicated over them): each passes 1/copies of the gradient, so the encoders' gradients
    sum to one copy's."""
    device = model.decoder.embed_tokens.weight.device
    vision, audio = model.vision, model.audio
    if vision is None and audio is None:  # a text model (every rank's): nothing to exchange
        return StepMedia(model.config.d_model, [], Resharded({}, torch.zeros((), device=device)),
                         {}, 0, copies)
    plan = local_reshard_plan(batch.plan, rank, world)
    inputs = _step_inputs(batch, set(plan.recv_items))
    row_width = vision.config.in_channels * vision.config.patch_size ** 2 if vision else 0
    n_mels = audio.config.n_mels if audio is not None else 0
    # the items' host tensors and their shapes on the host (the encoders read shapes there)
    outputs = model.encode_items(
        _cat(inputs.pixel_rows, (0, row_width), torch.uint8),
        torch.tensor(inputs.grids, dtype=torch.int64, device=HOST).reshape(-1, 3),
        torch.tensor([p.shape[0] for p in inputs.pixel_rows], dtype=torch.int64, device=HOST),
        _cat(inputs.mels, (0, n_mels), torch.float16),
        torch.tensor(inputs.frames, dtype=torch.int64, device=HOST))
    # The backward phases run encoder backward from these outputs; the step uses detached
    # leaves standing for them.
    encoder_outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    blocks: dict[ItemKey, torch.Tensor] = {}
    for name, keys in (("vision", inputs.vision_keys), ("audio", inputs.audio_keys)):
        if name not in outputs:
            continue
        out_ND, rows = outputs[name]
        leaf_ND = out_ND.detach().requires_grad_()
        encoder_outputs.append((out_ND, leaf_ND))
        blocks.update(zip(keys, leaf_ND.split(rows)) if rows else ())
    dim = model.config.d_model
    empty = torch.zeros(0, dim, device=device)
    sent = {key: blocks.get(key, empty) for key in plan.send_items}
    resharded = collectives.reshard_embeddings(sent, plan, group, dim=dim, dtype=empty.dtype,
                                               device=device)
    # items encoded here for another rank (what the encoder plan moved)
    moved = sum(n for r, n in enumerate(plan.send_counts) if r != rank)
    return StepMedia(dim, encoder_outputs, resharded, blocks, moved, copies)


class StepMedia:
    """The step's media embeddings (``encode_and_reshard`` builds them): ``items_for`` each
    micro-batch, ``backward`` once after every micro-batch's backward."""

    def __init__(self, dim: int, encoder_outputs, resharded, local: dict, moved: int,
                 copies: int = 1) -> None:
        self.dim, self.moved, self.copies = dim, moved, copies
        self._encoder_outputs = encoder_outputs
        self._resharded = resharded
        self._received = {key: block.detach().requires_grad_()
                          for key, block in resharded.items.items()}
        self._local = local

    def items_for(self, mb: PackedBatch) -> tuple[PackedBatch, list[torch.Tensor]]:
        """The micro-batch (labels of a sequence whose item never arrived ignored) and one
        ``[num_tokens, D]`` block per media item, in its media order."""
        items, lost = [], set()
        if mb.seq_refs is None:
            return mb, items
        for (key, *_), seq, n in zip(_batch_items(mb), mb.media_sample_M.tolist(),
                                     mb.media_num_tokens_M.tolist()):
            block = self._received.get(key)
            if block is None or block.shape[0] == 0:
                block = self._local.get(key)
            if block is None or block.shape[0] != n:
                lost.add(seq)
                block = torch.zeros(n, self.dim, device=self._any_device())
            items.append(block)
        if lost:
            cu = mb.cu_seqlens_S1.tolist()
            labels_T = mb.labels_T.clone()
            for seq in sorted(lost):
                labels_T[cu[seq]:cu[seq + 1]] = IGNORE_INDEX
                ref = mb.seq_refs[seq]
                warnings.warn(f"{ref.source}/{ref.key}: a media item did not arrive from its "
                              f"encoding rank; the sample is not trained this step",
                              stacklevel=2)
            mb = dataclasses.replace(mb, labels_T=labels_T)
        return mb, items

    def backward(self) -> None:
        """Phases 2-4 (phase 1 is the caller's per-micro-batch backward)."""
        if not self._resharded.zero.requires_grad:  # nothing was exchanged (a text model)
            return
        outs, grads = [self._resharded.zero], [torch.ones_like(self._resharded.zero)]
        for key, leaf in self._received.items():
            if leaf.grad is not None:
                outs.append(self._resharded.items[key])
                grads.append(leaf.grad)
        torch.autograd.backward(outs, grads)
        for out_ND, leaf_ND in self._encoder_outputs:
            if not out_ND.requires_grad:  # a frozen tower (optim.groups): nothing to reach,
                continue  # on every rank alike (the groups are the run's)
            grad = leaf_ND.grad if leaf_ND.grad is not None else torch.zeros_like(out_ND)
            torch.autograd.backward([out_ND], [grad / self.copies if self.copies > 1 else grad])

    def _any_device(self) -> torch.device:
        return self._resharded.zero.device


def _cat(tensors: list[torch.Tensor], empty_shape: tuple[int, int], dtype: torch.dtype
         ) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(empty_shape, dtype=dtype, device=HOST)
