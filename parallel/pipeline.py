"""Pipeline parallelism for the MoE decoder: `apply_pp` cuts the layers into one stage per rank
of the `pp` mesh axis and drives them with `torch.distributed.pipelining` (GPipe or 1F1B).

Stage 0 holds the token embeddings, the last stage the final norm and the LM head (the loss runs
there); every stage holds a contiguous run of layers, keyed by their index in the full model so
parameter names (and so checkpoints) match the unsplit `MoEDecoder`.

**Side inputs.** Micro-batches are pre-split on the data side: the trainer hands
`PipelineRunner.step` a list of packed micro-batches (`loaders.collate.PackedBatch` or anything
with `input_ids_T`, `labels_T`, `position_ids_T`, `cu_seqlens_S1`, `max_seqlen` and optionally
`mrope_3T`), each with its own `cu_seqlens`. The runner stacks them on a leading micro-batch
axis and passes the side inputs as keyword arguments of `schedule.step`; the pipelining API
splits keyword tensors along dim 0 and gives each stage its own copy, so only the hidden states
travel between ranks. Stages exchange shapes fixed when `apply_pp` builds them, so every
micro-batch is padded to one token budget, `microbatch_tokens`: the padding is its own packed
sequence with ignored labels (like any run padded to that budget, its tokens reach the router),
and `cu_seqlens` are padded with empty sequences to a common count.

**Router loss.** Each stage adds its MoE layers' `aux_loss_coef·aux + z_loss_coef·z` to a
running `[1]` tensor sent with the hidden states, so the last stage sees the whole model's
router loss and its gradient flows back through every stage like an activation.

**Objective.** Per micro-batch m, `loss_fn(ce_sum_m, router_loss_m, n_tokens, n_microbatches)`,
by default `ce_sum_m / n_tokens + router_loss_m / n_microbatches` with `n_tokens` the step's
counted labels: the sum over micro-batches is then exactly a single-process gradient-accumulation
step (`MoEDecoder.loss` sums, one division by the step's token count). Gradients are therefore
not rescaled by the schedule (`scale_grads=False`).

Shape suffixes: M micro-batches, T tokens per micro-batch, D model width, S sequences (S+1
boundaries), L MoE layers of this stage, E experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from omniscale import kernels
from omniscale.backbone.attention import rope_tables
from omniscale.backbone.decoder import MoEDecoder, grouped_loss
from omniscale.kernels.transfer import host_to_device
from omniscale.layout import IGNORE_INDEX
from omniscale.parallel.tensor import vocab_parallel_loss

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class DecoderStage(nn.Module):
    """Layers `[lo, hi)` of a `MoEDecoder` (sharing its modules, not copies), plus the
    embeddings on the first stage and the final norm + LM head on the last. `forward` takes
    token ids `[1, T]` (first stage) or `(hidden_1TD, router_loss_1)` and returns
    `(hidden_1TD, router_loss_1)`; the last stage's hidden states are final-normed."""

    def __init__(self, model: MoEDecoder, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.layer_range = (lo, hi)
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.load_LE: torch.Tensor | None = None  # expert loads summed over the step

    def reset_module(self, module: nn.Module) -> None:
        """The decoder's initial values (`MoEDecoder.reset_module`): a stage cut from a model
        built on the meta device is initialised as the whole decoder would be."""
        MoEDecoder.reset_module(self, module)

    def forward(self, x: torch.Tensor, router_loss_1: torch.Tensor | None = None, *,
                position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                mrope: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.embed_tokens is not None:
            x_TD = self.embed_tokens(x[0])
            router_loss_1 = x_TD.new_zeros(1, dtype=torch.float32)
        else:
            x_TD = x[0]
        cos_TK, sin_TK = rope_tables(self.config, position_ids[0],
                                     None if mrope is None else mrope[0])
        cos_TK, sin_TK = cos_TK.to(x_TD.dtype), sin_TK.to(x_TD.dtype)
        m, loads = self.config.moe, []
        for layer in self.layers.values():
            x_TD, aux = layer(x_TD, cos_TK, sin_TK, cu_seqlens[0], max_seqlen)
            if aux is not None:
                router_loss_1 = (router_loss_1 + m.aux_loss_coef * aux["aux_loss"]
                                 + m.z_loss_coef * aux["z_loss"])
                loads.append(aux["load_E"].detach())
        if loads:
            load_LE = torch.stack(loads)
            self.load_LE = load_LE if self.load_LE is None else self.load_LE + load_LE
        if self.norm is not None:
            x_TD = self.norm(x_TD)
        # fp32 between stages: under mixed precision FSDP casts the received sum to bf16
        return x_TD[None], router_loss_1.float()

    def loss(self, hidden_TD: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy, exactly `MoEDecoder.loss` (last stage only)."""
        weight_VD = (self.lm_head or self.embed_tokens).weight  # tied: pp = 1 holds both
        if isinstance(weight_VD, DTensor):  # apply_tp split the LM head over the vocabulary
            return vocab_parallel_loss(weight_VD, hidden_TD, labels_T)
        ce = kernels.get("linear_cross_entropy", hidden_TD.device)
        # bf16 mixed precision: the head computes in its weight's dtype (as MoEDecoder.loss)
        return ce(hidden_TD.to(weight_VD.dtype), weight_VD, labels_T, ignore_index=IGNORE_INDEX,
                  reduction="sum")

    def logits(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        """Whole [T, V] logits (last stage only; for evaluation, never for the loss): a head
        split over the vocabulary by `apply_tp` is gathered first."""
        weight_VD = (self.lm_head or self.embed_tokens).weight
        if isinstance(weight_VD, DTensor):
            weight_VD = weight_VD.full_tensor()
        return hidden_TD.to(weight_VD.dtype) @ weight_VD.T

    @torch.no_grad()
    def update_bias(self, load_LE: torch.Tensor) -> None:
        """Aux-loss-free balancing for this stage's MoE layers (`MoEDecoder.update_bias`)."""
        moes = [layer.ffn for layer in self.layers.values() if layer.is_moe]
        for moe, load_E in zip(moes, load_LE, strict=True):
            moe.update_bias(load_E)


def default_loss(ce_sum: torch.Tensor, router_loss: torch.Tensor, n_tokens: torch.Tensor,
                 n_microbatches: int) -> torch.Tensor:
    """One micro-batch's share of the step loss: mean cross-entropy over the step's counted
    tokens plus the mean router loss over micro-batches."""
    return ce_sum / n_tokens + router_loss / n_microbatches


class PipelineRunner:
    """Runs one pipelined training step on this rank's stage. `module` is the stage's
    `nn.Module`: give its parameters to the optimizer, read its `load_LE` (this stage's MoE
    layers' expert loads over the last step) for `module.update_bias`. Wrappers that act in
    place (`fully_shard`, checkpointing) may be applied to it after `apply_pp`.

    After a step the last stage also holds what a trainer logs, detached: `router_sum` (the
    micro-batches' router losses added up) and, when the step was given sequence groups,
    `loss_G` / `n_G` (summed cross-entropy and counted targets per group)."""

    def __init__(self, module: DecoderStage, stage: PipelineStage, schedule: str,
                 n_microbatches: int, loss_fn: Callable, microbatch_tokens: int):
        self.module, self.stage = module, stage
        self.n_microbatches = n_microbatches
        self.microbatch_tokens = microbatch_tokens
        self._loss_fn = loss_fn
        self._n_tokens: torch.Tensor | None = None
        self._router_divisor = n_microbatches
        self._num_groups = 0
        self._scorer: Callable | None = None  # evaluate()'s, while it runs
        self.router_sum: torch.Tensor | None = None
        self.loss_G: torch.Tensor | None = None
        self.n_G: torch.Tensor | None = None
        self.schedule = SCHEDULES[schedule](stage, n_microbatches, loss_fn=self._microbatch_loss,
                                            scale_grads=False)

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    def _microbatch_loss(self, output: tuple[torch.Tensor, torch.Tensor],
                         target: torch.Tensor) -> torch.Tensor:
        hidden_1TD, router_loss_1 = output
        hidden_TD = hidden_1TD[0]
        if self._scorer is not None:  # evaluate(): forward only, nothing to differentiate
            self._scorer(hidden_TD, target[0])
            return router_loss_1[0].new_zeros(())
        if self._num_groups:  # target [1, 2, T]: labels and each token's group
            labels_T, group_T = target[0]
            loss_G, n_G = grouped_loss(self.module.loss, hidden_TD, labels_T, group_T,
                                       self._num_groups)
            self.loss_G = self.loss_G + loss_G.detach()
            self.n_G = self.n_G + n_G
            ce_sum = loss_G.sum()
        else:
            ce_sum = self.module.loss(hidden_TD, target[0])
        self.router_sum = self.router_sum + router_loss_1[0].detach()
        return self._loss_fn(ce_sum, router_loss_1[0], self._n_tokens, self._router_divisor)

    def step(self, microbatches: Sequence, n_tokens: int | torch.Tensor | None = None,
             router_divisor: int | None = None, groups: Sequence[torch.Tensor] | None = None,
             num_groups: int = 0) -> torch.Tensor | None:
        """Forward and backward over the step's micro-batches (the same list on every rank of
        the pp group); gradients accumulate into the stage's parameters. `n_tokens` overrides
        the loss denominator (e.g. counted tokens summed over data-parallel ranks) and
        `router_divisor` the router loss's (e.g. micro-batches summed over data-parallel ranks
        and over several `step` calls). `groups[m]`: a group id per sequence of micro-batch m
        (`num_groups` of them) for the per-group loss split. Returns the loss (detached) on
        the last stage, None elsewhere."""
        ids_MT, labels_MT, kwargs = self._inputs(microbatches)
        device = self.stage.device
        if n_tokens is None:
            n_tokens = (labels_MT != IGNORE_INDEX).sum()
        elif not torch.is_tensor(n_tokens):
            n_tokens = torch.tensor(n_tokens, device=device)
        self._n_tokens = n_tokens
        self._router_divisor = router_divisor or self.n_microbatches
        self._num_groups = num_groups if groups is not None else 0
        target = labels_MT
        if self._num_groups:
            # padding rows (beyond each micro-batch's own sequences) fall in no group
            group_MT = torch.stack([_token_groups(mb, g, self.microbatch_tokens, num_groups)
                                    for mb, g in zip(microbatches, groups, strict=True)])
            target = torch.stack([labels_MT, host_to_device(group_MT, device)], dim=1)
        self.module.load_LE = None
        self.router_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.loss_G = torch.zeros(self._num_groups, dtype=torch.float32, device=device)
        self.n_G = torch.zeros(self._num_groups, dtype=torch.int64, device=device)
        losses: list[torch.Tensor] = []
        args = (ids_MT,) if self.is_first else ()
        self.schedule.step(*args, target=target if self.is_last else None, losses=losses,
                           return_outputs=False, **kwargs)
        return torch.stack(losses).sum().detach() if self.is_last else None

    def _inputs(self, microbatches: Sequence) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """`stack_microbatches` of a schedule run's micro-batches, on the stage's device."""
        if len(microbatches) != self.n_microbatches:
            raise ValueError(f"apply_pp: n_microbatches={self.n_microbatches}, the step got "
                             f"{len(microbatches)} micro-batches")
        ids_MT, labels_MT, kwargs = stack_microbatches(microbatches, self.microbatch_tokens)
        device = self.stage.device
        # copies that do not wait for the device (the stages' previous chunk may still run)
        kwargs = {k: host_to_device(v, device) if torch.is_tensor(v) else v
                  for k, v in kwargs.items()}
        return host_to_device(ids_MT, device), host_to_device(labels_MT, device), kwargs

    @torch.no_grad()
    def evaluate(self, microbatches: Sequence,
                 score: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Forward only over `n_microbatches` micro-batches (the same list on every rank of the
        pp group; no gradient, no parameter or bias changes): on the last stage
        `score(hidden_TD, labels_T)` sees each micro-batch's final-normed hidden states
        (padding rows' labels ignored); `module.logits` turns them into logits."""
        ids_MT, labels_MT, kwargs = self._inputs(microbatches)
        self._scorer = score
        try:
            args = (ids_MT,) if self.is_first else ()
            self.schedule.eval(*args, target=labels_MT if self.is_last else None, losses=[],
                               return_outputs=False, **kwargs)
        finally:
            self._scorer = None
            self.module.load_LE = None  # the evaluation's routing is no step's load


def _token_groups(mb, group_S: torch.Tensor, tokens: int, pad_group: int) -> torch.Tensor:
    """Each token's group id, padded to `tokens` with `pad_group` (a group nobody reads)."""
    lengths_S = mb.cu_seqlens_S1[1:] - mb.cu_seqlens_S1[:-1]
    group_T = torch.repeat_interleave(group_S.to(torch.int64), lengths_S.to(torch.int64))
    return nn.functional.pad(group_T, (0, tokens - group_T.shape[0]), value=pad_group)


def stack_microbatches(microbatches: Sequence, tokens: int
                       ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """`(input_ids_MT, labels_MT, side inputs)`: each micro-batch padded to `tokens` (one
    extra packed sequence of ignored labels) and its boundaries to a common count (empty
    sequences), stacked on dim 0 so `schedule.step` splits them back one per micro-batch."""
    ids, labels, pos, cus, mropes = [], [], [], [], []
    max_seqlen = 0
    for i, mb in enumerate(microbatches):
        t = int(mb.input_ids_T.shape[0])
        if t > tokens:
            raise ValueError(f"apply_pp: micro-batch {i} holds {t} tokens, over "
                             f"microbatch_tokens={tokens}")
        pad = tokens - t
        max_seqlen = max(max_seqlen, int(mb.max_seqlen), pad)
        ids.append(nn.functional.pad(mb.input_ids_T, (0, pad)))
        labels.append(nn.functional.pad(mb.labels_T, (0, pad), value=IGNORE_INDEX))
        pos.append(nn.functional.pad(mb.position_ids_T, (0, pad)))
        cu = mb.cu_seqlens_S1.to(torch.int32)
        cus.append(torch.cat([cu, cu.new_tensor([tokens])]) if pad else cu)
        mrope = getattr(mb, "mrope_3T", None)
        mropes.append(None if mrope is None else nn.functional.pad(mrope, (0, pad)))
    n_bounds = max(c.shape[0] for c in cus)
    cus = [torch.cat([c, c[-1:].expand(n_bounds - c.shape[0])]) for c in cus]
    kwargs = {"position_ids": torch.stack(pos), "cu_seqlens": torch.stack(cus),
              "max_seqlen": max_seqlen}  # not a tensor: every micro-batch gets the maximum
    if any(m is not None for m in mropes):
        if any(m is None for m in mropes):
            raise ValueError("apply_pp: mrope_3T must be given for all micro-batches or none")
        kwargs["mrope"] = torch.stack(mropes)
    return torch.stack(ids), torch.stack(labels), kwargs


def stage_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous `[lo, hi)` layer ranges, as even as possible (earlier stages take the
    remainder: the last stage also runs the LM head and the loss)."""
    if n_layers < n_stages:
        raise ValueError(f"apply_pp: {n_layers} layers cannot fill {n_stages} pipeline stages")
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return list(zip(bounds[:-1], bounds[1:]))


def apply_pp(model: MoEDecoder, pp_mesh, schedule: str, n_microbatches: int,
             loss_fn: Callable | None = None, *, microbatch_tokens: int,
             activation_dtype: torch.dtype | None = None,
             device: torch.device | None = None) -> PipelineRunner:
    """This rank's pipeline stage of `model` over the 1-D `pp_mesh`, and the runner of its
    schedule ("gpipe" or "1f1b"; 1F1B needs n_microbatches ≥ stages). The stage shares the
    model's modules; drop the full model afterwards to free the other stages' layers.
    `loss_fn(ce_sum, router_loss, n_tokens, n_microbatches)` defaults to `default_loss`.

    `microbatch_tokens` (the packer's token budget) fixes the shapes the stages exchange, so
    the stage is built with explicit input/output shapes: the pipelining API's runtime shape
    inference would otherwise run one extra no-grad forward on zeros (and count its routing).
    `activation_dtype`: what the stages send each other -- the compute dtype (bf16 under FSDP's
    mixed precision, applied after this: the parameters are still fp32 here), default the
    parameters' dtype. `device`: the stage's device (default the parameters', which a model
    built on the meta device does not have yet)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"apply_pp: schedule must be one of {sorted(SCHEDULES)}, "
                         f"got {schedule!r}")
    if model.lm_head is None and pp_mesh.size() > 1:
        raise ValueError("apply_pp: tie_embeddings=True puts the LM head on stage 0; "
                         "untie the embeddings to pipeline the model")
    n_stages, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    lo, hi = stage_layers(len(model.layers), n_stages)[rank]
    module = DecoderStage(model, lo, hi, first=rank == 0, last=rank == n_stages - 1)
    param = next(model.parameters())
    dtype, device = activation_dtype or param.dtype, device or param.device
    hidden = (torch.empty(1, microbatch_tokens, model.config.d_model, dtype=dtype,
                          device="meta"), torch.empty(1, dtype=torch.float32, device="meta"))
    inputs = torch.empty(1, microbatch_tokens, dtype=torch.long, device="meta") \
        if rank == 0 else hidden
    stage = PipelineStage(module, rank, n_stages, device, input_args=inputs,
                          output_args=hidden, group=pp_mesh.get_group())
    return PipelineRunner(module, stage, schedule, n_microbatches, loss_fn or default_loss,
                          microbatch_tokens)
