"""Shared pieces of the FSDP / TP / AC / DCP tests: a shrunk tiny MoE decoder, a fixed global
batch of packed sequences, its data-parallel shards, and a step whose loss is the global
token mean (each rank: its token-loss sum / the global token count, so gradients summed over
data-parallel ranks are the single-process gradients).

The omni helpers at the end build the tiny omni model (vision + audio encoders) and its
batches from rendered demo samples.

The decoder is wrapped in `TextLM` so embedding, decoder and loss run in one forward (FSDP
gathers a unit's parameters around its forward). Only the cross-entropy is compared: the
router's aux/z losses are per-micro-batch means, which no data split preserves.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from omniscale.backbone.config import ModelConfig, MoEConfig
from omniscale.backbone.decoder import MoEDecoder

# One dense layer (TP's dense FFN) and one MoE layer with a shared expert (TP's shared expert).
CONFIG = ModelConfig.preset("tiny", vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                            n_kv_heads=2, head_dim=16, mrope_sections=None, ffn_dim=128,
                            n_dense_layers=1,
                            moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=64,
                                          shared_expert=True, shared_ffn_dim=64))
LENGTHS = (23, 17, 31, 12)  # four sequences: one per rank on 4 data-parallel ranks


class TextLM(nn.Module):
    def __init__(self, config: ModelConfig = CONFIG):
        super().__init__()
        self.decoder = MoEDecoder(config)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        embeds_TD = self.decoder.embed_tokens(batch["input_ids_T"])
        hidden_TD, _ = self.decoder(embeds_TD, batch["position_ids_T"], batch["cu_seqlens_S1"],
                                    batch["max_seqlen"])
        return self.decoder.loss(hidden_TD, batch["labels_T"])


def build(seed: int = 0) -> TextLM:
    torch.manual_seed(seed)
    return TextLM()


def sequences(step: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of `step`: (input ids, shifted labels) per sequence."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, CONFIG.vocab_size, (n + 1,), generator=g)
        out.append((ids[:-1], ids[1:]))
    return out


def pack(seqs) -> dict:
    lengths = [len(ids) for ids, _ in seqs]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return {"input_ids_T": torch.cat([ids for ids, _ in seqs]),
            "labels_T": torch.cat([labels for _, labels in seqs]),
            "position_ids_T": torch.cat([torch.arange(n) for n in lengths]),
            "cu_seqlens_S1": cu, "max_seqlen": max(lengths)}


def shard(seqs, dp_rank: int, dp: int) -> dict:
    """Data-parallel rank `dp_rank`'s contiguous share of the global batch, packed."""
    per = len(seqs) // dp
    return pack(seqs[dp_rank * per:(dp_rank + 1) * per])


def global_tokens(seqs) -> int:
    return sum(len(labels) for _, labels in seqs)


def step_loss(model: nn.Module, batch: dict, n_global: int) -> torch.Tensor:
    """This rank's part of the global token-mean loss (backward not run)."""
    loss_sum, _ = model(batch)
    return loss_sum / n_global


def full_grads(model: nn.Module) -> dict[str, np.ndarray]:
    """Unsharded gradient of every parameter, by plain name (a collective under FSDP/TP).
    numpy, not tensors: a tensor sent through the harness's queue is shared by file
    descriptor, which breaks when the rank exits before the parent receives it."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().numpy().copy()
    return out


def reference(step: int = 0) -> tuple[float, dict[str, np.ndarray]]:
    """Single-process loss and gradients on the whole global batch."""
    model = build()
    seqs = sequences(step)
    loss = step_loss(model, pack(seqs), global_tokens(seqs))
    loss.backward()
    return loss.item(), full_grads(model)


def assert_grads_close(got: dict, want: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(torch.as_tensor(got[name]), torch.as_tensor(want[name]),
                                   rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def parallel_step(rank: int, world: int, dp_shard: int, tp: int, ac: str | None = None
                  ) -> tuple[float, dict | None]:
    """One step on a (dp_shard × tp) mesh: (global loss, full gradients on rank 0)."""
    import torch.distributed as dist

    from omniscale.parallel import ParallelDims, apply_ac, apply_fsdp, apply_tp

    dims = ParallelDims(dp_shard=dp_shard, tp=tp, world_size=world)
    dims.validate_for(CONFIG)
    mesh = dims.build_mesh("cpu")
    model = build()
    apply_tp(model, mesh["tp"])
    if ac:
        apply_ac(model, ac)
    if dp_shard > 1:
        apply_fsdp(model, mesh)
    seqs = sequences()
    loss = step_loss(model, shard(seqs, mesh["dp"].get_local_rank(), dims.dp),
                     global_tokens(seqs))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp_sp"].get_group())
    grads = full_grads(model)
    return total.item(), grads if rank == 0 else None


# ---- the tiny omni model (vision + audio encoders) on real demo batches --------------------

def omni_samples(kinds: list[str], tok_path) -> tuple[int, list]:
    """(vocabulary size, decoded demo samples) of the given kinds, through the loaders'
    decoders (tests/backbone/omni_batches.py)."""
    from tests.backbone.omni_batches import decoded, render, tokenizer

    rendered = render(kinds, seed=0)
    tok = tokenizer([c for _, _, c in rendered], tok_path)
    return tok.tokenizer.get_vocab_size(), [decoded(k, m, c, tok) for k, m, c in rendered]


def omni_collate(triples) -> "PackedBatch":  # noqa: F821 -- loaders.collate.PackedBatch
    """`(sample, sp_size, sp_index)` triples packed as a trainer's micro-batch."""
    from omniscale.loaders.collate import collate
    from tests.backbone.omni_batches import GEOMETRY

    return collate(triples, GEOMETRY)


def omni_model(vocab_size: int, hf_layouts: bool = False, **overrides):
    """The tiny omni model; ``hf_layouts``: its encoders in Qwen2-VL's and Whisper's layouts."""
    from omniscale.backbone.config import ModelConfig
    from omniscale.backbone.omni import OmniModel
    from omniscale.encoders.audio import AudioConfig
    from omniscale.encoders.vision import QWEN2_VL, VisionConfig

    torch.manual_seed(0)
    vision = VisionConfig.preset("tiny", **(QWEN2_VL if hf_layouts else {}))
    audio = AudioConfig.preset("tiny", **({"layout": "whisper"} if hf_layouts else {}))
    config = ModelConfig.preset("tiny", vocab_size=vocab_size, n_layers=2, d_model=64,
                                ffn_dim=128, vision=vision, audio=audio, **overrides)
    return OmniModel(config)


def omni_step(model, packed, n_global: int) -> torch.Tensor:
    """Encode, scatter, decode, backward; this rank's part of the global token-mean loss."""
    out = model(packed)  # idle encoders' zero term included
    loss = out["loss_sum"] / n_global
    loss.backward()
    return loss
