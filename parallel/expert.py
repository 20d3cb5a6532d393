"""Expert parallelism: each rank of the `ep` group holds E/ep of every MoE layer's experts and
tokens travel to the rank owning their expert and back (torchtitan's `apply_ep`).

`apply_ep` replaces each `Experts`' stacked weights [E, ...] with this rank's contiguous slice
[E/ep, ...] as plain Parameters and installs an `EPDispatcher` in `MoE.dispatcher`; the router
stays replicated (every rank routes its own tokens over all E experts).

Why plain local Parameters rather than DTensor Shard(0): `Experts` computes with ordinary
tensor ops (F.linear per expert, F.grouped_mm), which would need `to_local()` inside the
model; with local Parameters FSDP2 composes by `fully_shard(experts, mesh=<the data-parallel
mesh orthogonal to ep>)` like any module. A checkpoint sees local shapes: `Experts.ep_offset`
(first global expert held here) and `Experts.num_global_experts` say where the slice sits,
so DCP can wrap it with `DTensor.from_local(p, ep_mesh, [Shard(0)])` when saving.

Gradients: each rank's expert weights receive the gradients of every rank's tokens routed to
them (the combine all-to-all's backward brings them back); the router and all other replicated
parameters get this rank's tokens only and are summed by data-parallel reduction, as usual.

Shape suffixes: T tokens, D width, K routing choices, P = T·K routed copies, E global experts,
L experts on this rank (E/ep), R ranks of the ep group, M copies received here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from omniscale.backbone.config import kernel
from omniscale.backbone.moe import MoE
from omniscale.parallel.comm import (
    Group,
    all_to_all_single,
    exchange_counts,
    group_rank,
    group_size,
)


class EPDispatcher:
    """`MoE.dispatcher` for experts sharded over `group`: permute the token copies by expert,
    exchange per-expert counts, all-to-all the copies to the ranks owning their experts, run
    the local experts grouped by expert, all-to-all the outputs back, unpermute with the
    routing weights. Dropless; ranks may hold any number of tokens (0 included)."""

    def __init__(self, group: Group, num_experts: int, permute_kernel: str | None = None,
                 unpermute_kernel: str | None = None):
        self.group, self.num_experts = group, num_experts
        self.permute_kernel, self.unpermute_kernel = permute_kernel, unpermute_kernel
        self.ep = group_size(group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts}: must be divisible by the ep group "
                             f"size {self.ep}")
        self.local = num_experts // self.ep

    def __call__(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, weight_TK: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        permute = kernel("moe_permute", x_TD.device, self.permute_kernel)
        unpermute = kernel("moe_unpermute", x_TD.device, self.unpermute_kernel)
        x_PD, order_P, counts_E = permute(x_TD, expert_TK, self.num_experts)
        R, L = self.ep, self.local
        # recv_RL[j, l]: copies rank j sends here for local expert l.
        recv_RL = exchange_counts(counts_E.view(R, L), self.group)
        # The layer's one host sync: the all-to-all's split sizes (both directions at once).
        send_R, recv_R = torch.stack([counts_E.view(R, L).sum(1), recv_RL.sum(1)]).tolist()
        x_MD = all_to_all_single(x_PD, recv_R, send_R, self.group)

        # Received rows are grouped by source rank, then expert; the experts want them grouped
        # by expert. A stable sort on the expert id keeps each group in source-rank order.
        # (output_size given: repeat_interleave would otherwise read its total back.)
        expert_M = torch.arange(L, device=x_MD.device).repeat(R).repeat_interleave(
            recv_RL.reshape(-1).to(x_MD.device), output_size=x_MD.shape[0])
        by_expert_M = torch.argsort(expert_M, stable=True)
        if x_MD.shape[0]:
            y_MD = experts(x_MD[by_expert_M], recv_RL.sum(0))[torch.argsort(by_expert_M)]
        else:
            # Nothing to compute here, but the backward all-to-alls must still run on this
            # rank and the local experts need a (zero) gradient like every other rank's. The
            # experts are *called* (on one zero row), not read: under FSDP their weights are
            # gathered only around their own forward, and their gradient reduce-scatter is
            # issued by that forward's backward on every rank of the expert-FSDP group.
            # The dummy row hangs off x_MD (the all-to-all's output): FSDP2 fires the experts'
            # post-backward (their reduce-scatter) from a forward input that needs a gradient;
            # without one it defers it to the end of backward, after this rank's next
            # all-to-alls, while the ranks that received tokens reduce-scatter first: on 4
            # ranks (experts FSDP-sharded over 2) the two orders deadlocked.
            one_1D = x_MD.new_zeros(1, x_MD.shape[1]) + 0.0 * x_MD.sum()
            counts_L = torch.zeros(L, dtype=recv_RL.dtype, device=recv_RL.device)
            counts_L[0] = 1
            y_MD = x_MD + 0.0 * experts(one_1D, counts_L).sum()

        y_PD = all_to_all_single(y_MD, send_R, recv_R, self.group)
        if x_TD.shape[0] == 0:  # unpermute cannot view 0 rows as [0, K, D]; keep the graph
            return y_PD + 0.0 * weight_TK.sum()
        return unpermute(y_PD, order_P, weight_TK)


def apply_ep(model: nn.Module, ep_mesh: Group) -> nn.Module:
    """Shard every MoE layer of `model` over the 1-D mesh (or process group) `ep_mesh`, in
    place: rank i keeps experts [i·E/ep, (i+1)·E/ep) and dispatches through an `EPDispatcher`.
    Apply before FSDP; a no-op when the group has one rank. Returns `model`."""
    ep, rank = group_size(ep_mesh), group_rank(ep_mesh)
    if ep == 1:
        return model
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        if getattr(experts, "num_global_experts", None) is not None:
            raise ValueError("apply_ep: the model's experts are already sharded")
        local = module.dispatcher  # keep its kernel choices (LocalDispatcher's prefer=)
        dispatcher = EPDispatcher(ep_mesh, module.num_experts,
                                  getattr(local, "permute_kernel", None),
                                  getattr(local, "unpermute_kernel", None))
        lo, hi = rank * dispatcher.local, (rank + 1) * dispatcher.local
        with torch.no_grad():  # a frozen weight (the trainer's optim.groups) stays frozen
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(experts, name)
                setattr(experts, name, nn.Parameter(weight[lo:hi].clone(),
                                                    requires_grad=weight.requires_grad))
        experts.num_experts, experts.num_global_experts, experts.ep_offset = hi - lo, \
            module.num_experts, lo
        # checkpoints (parallel/dcp.py) describe the slices over the mesh the group came from
        experts.ep_mesh = ep_mesh if isinstance(ep_mesh, DeviceMesh) else None
        module.dispatcher = dispatcher
    return model
