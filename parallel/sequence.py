"""Ulysses sequence parallelism with the long-short split (DeepSpeed-Ulysses; the plan's SP).

The plan splits only the samples too long for one rank: such a sample's tokens are cut into k
slices held by an aligned group of k ranks ([g·k, (g+1)·k) on the SP mesh, slice j on the
group's j-th rank; `loaders.collate` builds the slices), while every other sample of the same
micro-batch stays whole on its rank. The slices are equal, or sized by the ranks' speeds when
the plan says so (`balancer.speed_split`: a slower rank holds fewer tokens; the batch's
`seq_sp_slices`). Everything in the decoder is token-wise except attention, so only the
attention core changes: for each split sequence, one all-to-all turns this rank's [T_j, H, K]
rows of q, k and v into [T, H/k, K] (the whole sequence, 1/k of the heads; rank i sends each
rank its T_j rows and receives T_i from each), the core attends over the whole sequence, and a
second all-to-all brings the outputs back to [T_j, H, K]. Whole sequences attend locally with
no collective, so a micro-batch without split sequences communicates nothing. RoPE needs
nothing: the slice's position ids are already the sample's global positions (collate), and
rotary runs before the exchange.

Heads sized by speed: when the plan gives a split sequence's group head counts h_j (Σ = H,
``sp_heads``: `balancer.speed_split`), rank j attends its contiguous h_j query heads instead of
H/k -- a slow rank then holds less of the attention too, which equal heads fix at 1/k whatever
its slice. The exchanges are the same all-to-alls with rows of h_j query heads and the kv heads
they use (a kv head whose query heads fall on two ranks goes to both; a rank whose heads are not
whole kv groups repeats its kv heads to one per query head after the exchange).

GQA: the k ranks take contiguous chunks of H/k query heads; when the G key/value heads divide
by k each rank takes the G/k kv heads its query heads use. Otherwise every kv head is repeated
to H (one per query head) before the exchange: correct, at the cost of sending H instead of G
kv heads (H must divide by k).

Process groups: `apply_sp` creates this rank's aligned group once per k = 2, 4, … up to
`sp_max` (`SPGroups`; k = W reuses the mesh's own group). Nothing is created per step.

The batch's layout reaches the cores through `sp_batch(model, batch)`, a context manager around
the forward (the cores refuse to run outside it, since a split sequence attended locally would
be silently wrong). The split sequences of one micro-batch that share a group (H/k heads each)
are exchanged together: one all-to-all there and one back per layer, and one call of the core
over all of them, whatever their number (VeOmni's packed exchange; one per sequence was a
fixed cost per split sequence the planner does not price). The exchanges follow batch order
(a group's at its first sequence), which must be the same on every rank of their groups (plan
order is); a sequence with heads sized by speed is exchanged alone.

Shape suffixes: T tokens, H query heads, G kv heads, K head dim, C heads sent per rank chunk,
S sequences, W ranks of the SP mesh.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from omniscale.backbone.attention import Attention
from omniscale.kernels.transfer import HOST, host_to_device
from omniscale.parallel.comm import Group, all_to_all_single, group_rank, group_size, process_group


class SPGroups:
    """This rank's aligned SP group for each split size k (a power of two ≤ sp_max).

    Only the members of a group create it (`use_local_synchronization`), so the SP mesh may be
    one slice of a larger mesh whose other slices build their own groups. Such groups are named
    by their ranks: build one `SPGroups` per mesh per process and share it (`apply_sp`'s
    `groups`) rather than creating the same rank set twice."""

    def __init__(self, sp_mesh: Group, sp_max: int | None = None):
        pg = process_group(sp_mesh)
        W, self.position = group_size(pg), group_rank(pg)
        ranks = dist.get_process_group_ranks(pg)
        sp_max = W if sp_max is None else sp_max
        if sp_max < 1 or sp_max & (sp_max - 1) or W % sp_max:
            raise ValueError(f"sp_max={sp_max}: must be a power of two dividing the SP mesh "
                             f"size {W}")
        self.groups: dict[int, dist.ProcessGroup] = {}
        k = 2
        while k <= sp_max:
            first = self.position // k * k
            self.groups[k] = pg if k == W else dist.new_group(
                ranks[first:first + k], use_local_synchronization=True)
            k *= 2

    def group(self, k: int, index: int) -> dist.ProcessGroup:
        if k not in self.groups:
            raise ValueError(f"a sequence split over {k} ranks, but the SP groups go up to "
                             f"{max(self.groups, default=1)} (apply_sp's sp_max)")
        if self.position % k != index:
            raise ValueError(f"SP slice {index} of {k} on SP-mesh rank {self.position}: "
                             f"slices must sit on aligned groups, slice j on rank g·k + j")
        return self.groups[k]


@dataclass
class SPLayout:
    """One micro-batch seen by the cores: its whole sequences (gathered for one local call)
    and its split ones, as the exchanges that carry them (`Exchange`)."""

    local_T: torch.Tensor  # int64: rows of whole sequences
    local_cu_S1: torch.Tensor  # int32: their boundaries within local_T
    local_max: int
    exchanges: list["Exchange"]  # the split sequences, as the exchanges that carry them

    @classmethod
    def of(cls, batch, groups: SPGroups, device: torch.device) -> "SPLayout":
        bounds = batch.cu_seqlens_S1.tolist()
        local, cu, split = [], [0], []
        sliced = batch.seq_sp_slices or [None] * (len(bounds) - 1)
        headed = getattr(batch, "seq_sp_heads", None) or [None] * (len(bounds) - 1)
        for s, (k, index) in enumerate(zip(batch.seq_sp_size_S.tolist(),
                                           batch.seq_sp_index_S.tolist())):
            a, b = bounds[s], bounds[s + 1]
            if k == 1:
                local.append(torch.arange(a, b, device="cpu"))
                cu.append(cu[-1] + b - a)
            else:
                rows = list(sliced[s]) if sliced[s] is not None else [b - a] * k
                if rows[index] != b - a:
                    raise ValueError(f"SP slice {index} of sequence {s} holds {b - a} tokens, "
                                     f"but its slice lengths say {rows}")
                heads = list(headed[s]) if headed[s] is not None else None
                if heads is not None and (len(heads) != k or min(heads) < 1):
                    raise ValueError(f"SP heads {heads} of sequence {s}: not {k} counts of at "
                                     "least one head")
                split.append((a, b, k, groups.group(k, index), rows, heads))
        # made on the host (the batch's bounds are read there), copied to the device once per
        # micro-batch without waiting for it
        local_T = torch.cat(local) if local else torch.zeros(0, dtype=torch.int64,
                                                              device="cpu")
        local_cu_S1 = torch.tensor(cu, dtype=torch.int32, device="cpu")
        return cls(host_to_device(local_T, device), host_to_device(local_cu_S1, device),
                   max((y - x for x, y in zip(cu, cu[1:])), default=0),
                   [Exchange.of(entries, device) for entries in _exchange_batches(split)])


@dataclass
class Exchange:
    """Split sequences of one group that one exchange carries, made once per micro-batch (every
    layer's attention reuses it; its index tensors copied to the device once, without waiting):
    every sequence with H/k heads each of the group, or one with heads sized by speed."""

    group: dist.ProcessGroup
    k: int
    rows_T: torch.Tensor  # int64: this rank's rows of the sequences, sequence after sequence
    from_R: list[int]  # rows arriving from each rank of the group (one sequence: its slices)
    heads: list[int] | None  # every rank's query heads (one sequence), None for H/k each
    order_L: torch.Tensor | None  # H/k each: arrival order (rank, then sequence) -> sequences
    cu_S1: torch.Tensor | None  # H/k each: the whole sequences' boundaries, in that order
    max_len: int

    @classmethod
    def of(cls, entries: list[tuple], device: torch.device) -> "Exchange":
        """From ``SPLayout.of``'s split entries (start, end, k, group, slice rows, heads) of
        one exchange (``_exchange_batches``)."""
        _, _, k, group, rows, heads = entries[0]
        rows_T = host_to_device(torch.cat([torch.arange(a, b, device=HOST)
                                           for a, b, *_ in entries]), device)
        if heads is not None:
            return cls(group, k, rows_T, rows, heads, None, None, sum(rows))
        rows_S = [rows for *_, rows, _ in entries]
        from_R = [sum(rows[i] for rows in rows_S) for i in range(k)]
        start_R = [sum(from_R[:i]) for i in range(k)]
        order, cu = [], [0]
        for rows in rows_S:
            for i, n in enumerate(rows):
                order.append(torch.arange(start_R[i], start_R[i] + n, device=HOST))
                start_R[i] += n
            cu.append(cu[-1] + sum(rows))
        return cls(group, k, rows_T, from_R, None,
                   host_to_device(torch.cat(order), device),
                   host_to_device(torch.tensor(cu, dtype=torch.int32, device=HOST), device),
                   max(sum(rows) for rows in rows_S))


class UlyssesCore:
    """Wraps an attention core (`backbone.attention.VarlenCore`): whole sequences go to it
    directly, split ones through the Ulysses exchange (module docstring)."""

    def __init__(self, inner, n_heads: int, n_kv_heads: int, groups: SPGroups):
        self.inner, self.n_heads, self.n_kv_heads = inner, n_heads, n_kv_heads
        self.groups = groups
        self.layout: SPLayout | None = None

    def __call__(self, q_THK, k_TGK, v_TGK, cu_seqlens_S1, max_seqlen):
        layout = self.layout
        if layout is None:
            raise RuntimeError("sequence-parallel attention ran outside "
                               "omniscale.parallel.sequence.sp_batch(model, batch)")
        if not layout.exchanges:
            return self.inner(q_THK, k_TGK, v_TGK, cu_seqlens_S1, max_seqlen)
        o_THK = q_THK.new_zeros(q_THK.shape)
        if layout.local_T.numel():
            idx_T = layout.local_T
            o_local = self.inner(q_THK[idx_T], k_TGK[idx_T], v_TGK[idx_T],
                                 layout.local_cu_S1, layout.local_max)
            o_THK = o_THK.index_copy(0, idx_T, o_local)
        for ex in layout.exchanges:
            q, kk, v = q_THK[ex.rows_T], k_TGK[ex.rows_T], v_TGK[ex.rows_T]
            if ex.heads is None:
                o_seq = self._ulysses_many(q, kk, v, ex)
            else:
                o_seq = self._ulysses_by_heads(q, kk, v, ex.group, ex.from_R, ex.heads)
            o_THK = o_THK.index_copy(0, ex.rows_T, o_seq)
        return o_THK

    def _ulysses_many(self, q_THK, k_TGK, v_TGK, ex: Exchange) -> torch.Tensor:
        """Split sequences of one group, H/k heads each, exchanged together: this rank's rows
        of each (``q_THK``: the sequences' rows one after the other) in one all-to-all, every
        sequence attended whole in one call of the core (its own boundaries), the outputs back
        in a second. Rank j gets chunk j of the heads of all the rows; what arrives is by
        sending rank, then by sequence (``ex.order_L`` puts it in sequence order for the core,
        and the outputs back in arrival order after it)."""
        T, H, K = q_THK.shape
        k = ex.k
        if H % k:
            raise ValueError(f"n_heads={H}: must be divisible by the SP group size {k}")
        if self.n_kv_heads % k:  # replicate kv heads: one per query head
            k_TGK = k_TGK.repeat_interleave(H // self.n_kv_heads, dim=1)
            v_TGK = v_TGK.repeat_interleave(H // self.n_kv_heads, dim=1)
        G = k_TGK.shape[1]
        # [T, k, C, K] with chunk i = (query heads, kv heads, kv heads) for rank i; rank-major
        # rows so that chunk i of every rank lands on rank i
        chunks = [t.reshape(T, k, t.shape[1] // k, K) for t in (q_THK, k_TGK, v_TGK)]
        send = torch.cat(chunks, dim=2).transpose(0, 1).reshape(k * T, -1, K)
        recv = all_to_all_single(send, ex.from_R, [T] * k, group=ex.group)  # [Σ L, C, K]
        q, kk, v = recv.index_select(0, ex.order_L).split([H // k, G // k, G // k], dim=1)
        o_seq = self.inner(q.contiguous(), kk.contiguous(), v.contiguous(), ex.cu_S1,
                           ex.max_len)
        o_arrived = o_seq.new_empty(o_seq.shape).index_copy(0, ex.order_L, o_seq)
        # [k (head chunk), T, H/k, K]
        back = all_to_all_single(o_arrived, [T] * k, ex.from_R, group=ex.group)
        return back.view(k, T, H // k, K).transpose(0, 1).reshape(T, H, K)

    def _ulysses_by_heads(self, q_THK, k_TGK, v_TGK, group, rows: list[int],
                          heads: list[int]) -> torch.Tensor:
        """One split sequence whose ranks attend ``heads[j]`` query heads each (Σ = H): rank j
        gets every rank's rows of its contiguous query heads and of the kv heads they use (a
        kv head shared by two ranks' query heads goes to both). The same two all-to-alls as
        :meth:`_ulysses_many`, with rows of uneven width sent flat ([rows·width, K] each way)."""
        T, H, K = q_THK.shape
        G = k_TGK.shape[1]
        i = group_rank(group)
        if sum(heads) != H:
            raise ValueError(f"SP heads {heads}: sum to {sum(heads)}, the model has {H}")
        per = H // G  # query heads per kv head
        first = [sum(heads[:j]) for j in range(len(heads) + 1)]
        kv = [(first[j] // per, (first[j + 1] - 1) // per + 1) for j in range(len(heads))]
        width = [h + 2 * (b - a) for h, (a, b) in zip(heads, kv)]
        # to rank j: my T rows of its query heads and their kv heads, flat
        send = torch.cat([torch.cat([q_THK[:, first[j]:first[j + 1]], k_TGK[:, a:b],
                                     v_TGK[:, a:b]], dim=1).reshape(-1, K)
                          for j, (a, b) in enumerate(kv)])
        h, (a, b) = heads[i], kv[i]
        recv = all_to_all_single(send, [n * width[i] for n in rows], [T * w for w in width],
                                 group=group)
        L = sum(rows)
        q, kk, v = recv.view(L, width[i], K).split([h, b - a, b - a], dim=1)
        if first[i] % per or h % per:  # not whole kv groups: one kv head per query head
            use = torch.arange(first[i], first[i + 1], device=q.device) // per - a
            kk, v = kk.index_select(1, use), v.index_select(1, use)
        cu_S1 = torch.arange(2, dtype=torch.int32, device=q.device) * L
        o_LhK = self.inner(q.contiguous(), kk.contiguous(), v.contiguous(), cu_S1, L)
        back = all_to_all_single(o_LhK.reshape(-1, K), [T * x for x in heads],
                                 [n * h for n in rows], group=group)
        pieces = back.split([T * x for x in heads])  # from rank j: my rows of its heads
        return torch.cat([p.view(T, x, K) for p, x in zip(pieces, heads)], dim=1)


def _exchange_batches(split: list[tuple]) -> list[list[tuple]]:
    """The micro-batch's split sequences as the exchanges that carry them: every sequence of
    one group with H/k heads each in one exchange, at its first sequence's place in batch
    order (every rank of a group sees the group's sequences in the same order, and two ranks
    sharing two groups see them in the same order too: the exchanges keep the order the
    per-sequence ones had); a sequence with heads sized by speed alone."""
    batches: list[list[tuple]] = []
    by_group: dict[int, list[tuple]] = {}
    for entry in split:
        group, heads = entry[3], entry[5]
        if heads is not None:
            batches.append([entry])
        elif id(group) in by_group:
            by_group[id(group)].append(entry)
        else:
            by_group[id(group)] = [entry]
            batches.append(by_group[id(group)])
    return batches


def apply_sp(model: nn.Module, sp_mesh: Group, sp_max: int | None = None,
             groups: SPGroups | None = None) -> nn.Module:
    """Wrap every attention core of `model` in place for Ulysses over the aligned groups of
    `sp_mesh` (1-D mesh or process group; split sizes up to `sp_max`, default its size;
    `groups` reuses the groups an earlier call built for the same mesh). Run each forward
    inside `sp_batch(model, batch)`. A no-op on a 1-rank mesh."""
    if group_size(sp_mesh) == 1:
        return model
    groups = groups if groups is not None else SPGroups(sp_mesh, sp_max)
    for module in model.modules():
        if isinstance(module, Attention):
            if isinstance(module.core, UlyssesCore):
                raise ValueError("apply_sp: the model's attention is already sequence-parallel")
            module.core = UlyssesCore(module.core, module.n_heads, module.n_kv_heads, groups)
    return model


@contextlib.contextmanager
def sp_batch(model: nn.Module, batch):
    """Within the block, the model's Ulysses cores attend per `batch`'s layout (a
    `loaders.collate.PackedBatch`: `cu_seqlens_S1`, `seq_sp_size_S`, `seq_sp_index_S`).
    Backward needs no layout (the exchanges keep their groups) and may run after the block.
    A no-op for a model without `apply_sp`."""
    cores = [m.core for m in model.modules()
             if isinstance(m, Attention) and isinstance(m.core, UlyssesCore)]
    device = next(model.parameters()).device
    layout = SPLayout.of(batch, cores[0].groups, device) if cores else None
    for core in cores:
        core.layout = layout
    try:
        yield
    finally:
        for core in cores:
            core.layout = None
