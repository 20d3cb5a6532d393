"""The omni model: encoders' outputs scattered into the MoE decoder's placeholder tokens.

A packed batch (``loaders.collate.PackedBatch``) holds every sequence's tokens, with each media
item's placeholder block filled with its marker's id, and the media tensors of the items whose
blocks it holds. The model embeds the tokens, encodes the media, overwrites each block with its
item's embeddings, runs the decoder and scores next-token predictions; labels already ignore
media and prompt positions, so the loss is over text only.

The step is split in two because the trainer need not encode the items it decodes: the encoder
plan balances encoder work across ranks, and the embeddings are resharded between the calls.

- :meth:`OmniModel.encode_media` -- run the encoders on a batch's items (or any batch-shaped
  set of items) and return one embedding block per media item;
- :meth:`OmniModel.forward_with_media` -- scatter blocks into placeholders, decode, score.

Every encoder runs every step. When a modality has no items, its encoder runs on a tiny dummy
input and ``0 * sum(output)`` joins the loss: each of its parameters then gets a zero gradient,
so every rank issues the same collectives (FSDP gathers and reduce-scatters, the reshard's
all-to-all) whatever its batch holds (VeOmni's rule).

Shape suffixes: T tokens, D LLM width, N media rows, M media items, V vision items, A audio
items, P patches, C patch values, R mel frames, B mel bins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from omniscale.backbone.config import ModelConfig
from omniscale.backbone.decoder import MoEDecoder
from omniscale.encoders.audio import AudioConfig, AudioEncoder
from omniscale.encoders.vision import VisionConfig, VisionEncoder
from omniscale.encoders.vision_input import vision_patches
from omniscale.kernels.transfer import host_to_device
from omniscale.media import MEDIA_KINDS

AUDIO = MEDIA_KINDS.index("audio")  # media_kind_M id of an audio clip


@dataclass
class MediaEmbeddings:
    """One ``[num_tokens, D]`` block per media item, in the batch's media order, and the
    zero-valued term that ties every idle encoder into the loss (add it to the loss on the
    rank that encoded, whatever rank decodes the blocks)."""

    items: list[torch.Tensor]
    zero: torch.Tensor


class OmniModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.decoder = MoEDecoder(config)
        vision, audio = _config(VisionConfig, config.vision), _config(AudioConfig, config.audio)
        self.vision = VisionEncoder(vision, config.d_model) if vision else None
        self.audio = AudioEncoder(audio, config.d_model) if audio else None

    # ---- step 1: encoders ----------------------------------------------------------------

    def encode_media(self, batch) -> MediaEmbeddings:
        """Embeddings of every media item of ``batch`` (fields ``pixel_rows_RQ``,
        ``vision_grid_thw_V3``, ``vision_rows_V``, ``audio_mel_AF``, ``audio_frames_A``,
        ``media_kind_M``, ``media_index_M``, ``media_num_tokens_M``)."""
        device = self.decoder.embed_tokens.weight.device
        zero = torch.zeros((), device=device)
        rows: dict[str, list[torch.Tensor]] = {"vision": [], "audio": []}
        outputs = self.encode_items(batch.pixel_rows_RQ, batch.vision_grid_thw_V3,
                                    batch.vision_rows_V, batch.audio_mel_AF, batch.audio_frames_A)
        for name, (out_ND, lengths) in outputs.items():
            if lengths:
                rows[name] = list(out_ND.split(lengths))
            else:  # a dummy input's output: joins the loss with weight 0
                zero = zero + 0.0 * out_ND.sum()
        vision_rows, audio_rows = rows["vision"], rows["audio"]

        items = []
        for kind, index, n in zip(batch.media_kind_M.tolist(), batch.media_index_M.tolist(),
                                  batch.media_num_tokens_M.tolist()):
            block = (audio_rows if kind == AUDIO else vision_rows)[index]
            if block.shape[0] != n:
                raise ValueError(f"media item (kind {kind}, row {index}): the encoder gave "
                                 f"{block.shape[0]} embeddings for a {n}-token placeholder")
            items.append(block)
        return MediaEmbeddings(items, zero)

    def encode_items(self, pixel_rows_RQ: torch.Tensor, vision_grid_thw_V3: torch.Tensor,
                     vision_rows_V: torch.Tensor, audio_mel_RB: torch.Tensor,
                     audio_frames_A: torch.Tensor) -> dict[str, tuple[torch.Tensor, list[int]]]:
        """Each encoder once over a set of items (the trainer's encoder plan): per encoder,
        ``(out_ND, rows per item)``. Media arrive as the loader ships them (uint8 pixel rows,
        float16 log-mel) and become the encoders' float32 inputs on this device. An encoder
        with no items runs its dummy input and returns that output with no items (``[]``), so
        the caller can run its backward, with zero gradients, on every rank alike."""
        device = self.decoder.embed_tokens.weight.device
        out: dict[str, tuple[torch.Tensor, list[int]]] = {}
        for name, encoder, counts in (("vision", self.vision, vision_grid_thw_V3),
                                      ("audio", self.audio, audio_frames_A)):
            if encoder is None:
                if counts.shape[0]:
                    raise ValueError(f"items for the {name} encoder but the model has none "
                                     f"(config.{name} is None)")
                continue
            if not counts.shape[0]:
                out[name] = (encoder(*encoder.dummy_inputs(device)), [])
                continue
            if name == "vision":
                inputs = vision_patches(host_to_device(pixel_rows_RQ, device),
                                        vision_grid_thw_V3, vision_rows_V,
                                        encoder.config.temporal_patch_size)
            else:
                inputs = host_to_device(audio_mel_RB, device).to(torch.float32)
            out_ND = encoder(inputs, counts)
            out[name] = (out_ND, encoder.output_lengths(counts).tolist())
        return out

    # ---- step 2: scatter + decoder -------------------------------------------------------

    def decode(self, batch, items: list[torch.Tensor], zero: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict]:
        """``(hidden_TD, aux)``: ``batch`` decoded with ``items[m]`` in media item m's
        placeholder block (final-normed hidden states, and the decoder's router terms).
        ``zero`` (MediaEmbeddings.zero) joins the embeddings, so backward reaches every encoder
        through the decoder on every rank, in the same order whether or not the rank had media
        (FSDP issues collectives in that order). The loss is the caller's
        (``decoder.loss``, or a trainer's split of it)."""
        # Copies from the host that overlap the device's work (a blocking copy would wait for
        # it first; the loader pins its batches already).
        embeds_TD = self.decoder.embed_tokens(host_to_device(
            batch.input_ids_T, self.decoder.embed_tokens.weight.device))
        embeds_TD = scatter_media(embeds_TD, batch.media_token_start_M, items,
                                  batch.media_sample_M, batch.cu_seqlens_S1)
        if zero is not None:
            embeds_TD = embeds_TD + zero.to(embeds_TD.dtype)
        device = embeds_TD.device
        return self.decoder(embeds_TD, host_to_device(batch.position_ids_T, device),
                            host_to_device(batch.cu_seqlens_S1, device), batch.max_seqlen,
                            mrope_3T=host_to_device(batch.mrope_3T, device))

    def forward_with_media(self, batch, items: list[torch.Tensor],
                           zero: torch.Tensor | None = None) -> dict:
        """``decode`` and the loss: ``loss_sum`` (next-token cross-entropy summed over text
        targets), ``n_tokens`` and ``aux``."""
        hidden_TD, aux = self.decode(batch, items, zero)
        loss_sum, n_tokens = self.decoder.loss(
            hidden_TD, host_to_device(batch.labels_T, hidden_TD.device))
        return {"loss_sum": loss_sum, "n_tokens": n_tokens, "aux": aux}

    def forward(self, batch) -> dict:
        """Both steps on one rank; the idle encoders' zero term joins the embeddings."""
        media = self.encode_media(batch)
        return self.forward_with_media(batch, media.items, media.zero)


def _config(cls, value):
    """An encoder config from a dataclass, a dict (a YAML run config's section) or None."""
    return cls(**value) if isinstance(value, dict) else value


def scatter_media(embeds_TD: torch.Tensor, token_start_M: torch.Tensor,
                  items: list[torch.Tensor], seq_M: torch.Tensor | None = None,
                  cu_seqlens_S1: torch.Tensor | None = None) -> torch.Tensor:
    """``embeds_TD`` with rows ``start_m .. start_m + len(items[m])`` replaced by item m's
    embeddings (out of place, differentiable in both). A block may overhang its sequence when
    that is a sequence-parallel slice of its sample: only the rows inside the sequence land
    (item m's sequence ``seq_M[m]``, bounded by ``cu_seqlens_S1``; without them, the batch),
    never those of the sequences packed beside it."""
    T = embeds_TD.shape[0]
    if seq_M is None:
        bounds = [(0, T)] * len(items)
    else:
        cu = cu_seqlens_S1.tolist()
        bounds = [(cu[s], cu[s + 1]) for s in seq_M.tolist()]
    positions, rows = [], []
    for start, block_ND, (first, end) in zip(token_start_M.tolist(), items, bounds):
        lo, hi = max(start, first), min(start + block_ND.shape[0], end)
        if hi <= lo:
            continue
        positions.append(torch.arange(lo, hi, device=embeds_TD.device))
        rows.append(block_ND[lo - start:hi - start])
    if not rows:
        return embeds_TD
    pos_N = torch.cat(positions)
    return embeds_TD.index_copy(0, pos_N, torch.cat(rows).to(embeds_TD.dtype))
