"""Named device meshes: the backbone's axes, the experts' view of them, and the encoders' own.

`ParallelDims` is the one place that knows how the world is split (torchtitan's rule): code
asks a mesh for a group by name (`mesh["tp"]`, `mesh["dp_shard_sp"]`) and never assumes a 1-D
world. Nothing here is global: every mesh is built on demand and passed explicitly.

Backbone mesh, outermost to innermost (rank = row-major index, `tp` fastest):

    pp × dp_replicate × dp_shard × sp × tp

plus flattened axes: `dp` (dp_replicate·dp_shard: ranks holding different data), `dp_shard_sp`
(FSDP's shard group: SP ranks hold different tokens, so their gradients are reduced too) and
`dp_sp` (where a loss or token count is summed). Every axis exists even at size 1.

Expert parallelism borrows ranks instead of adding them (torchtitan's rule): `ep` must divide
dp_shard·sp, and the expert mesh splits the same ranks as

    pp × dp_replicate × edp_shard × ep × tp      (edp_shard = dp_shard·sp / ep)

so experts are sharded over `ep` and FSDP-sharded over `edp_shard`, while every other parameter
is FSDP-sharded over `dp_shard_sp` on the same ranks.

Encoders run in decoupled groups (DESIGN.md): each rank encodes the items its encoder plan
gives it, whatever its backbone coordinates, so the encoder mesh spans the whole world as
`encoder_dp_replicate × encoder_dp_shard × encoder_tp`, its own FSDP layout. `encoder_tp`
(default 1) splits each encoder's heads and FFN over adjacent ranks, which then encode the
same items (the encoder plan treats such a group as one encoder rank).

Impossible layouts fail here, before any process group exists, with one line naming the axis
(`ValueError`); so do layouts the `apply_*` functions cannot run yet (pp with sp, pp with
encoders), rather than hanging or failing mid-step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

BACKBONE_AXES = ("pp", "dp_replicate", "dp_shard", "sp", "tp")
EXPERT_AXES = ("pp", "dp_replicate", "edp_shard", "ep", "tp")
ENCODER_AXES = ("encoder_dp_replicate", "encoder_dp_shard", "encoder_tp")


@dataclass
class ParallelDims:
    """How `world_size` ranks are split. `dp_shard=-1` / `encoder_dp_shard=-1`: whatever the
    other axes leave (`encoder_dp_shard=-1`: world_size / encoder_tp). Raises `ValueError`
    with one line naming the axis when the split is impossible; `validate_for(config)` adds
    the checks that need the model's shapes."""

    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = 1
    sp: int = 1
    tp: int = 1
    pp: int = 1
    encoder_dp_shard: int = -1
    world_size: int = 1
    encoder_tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "ep", "sp", "tp", "pp", "world_size", "encoder_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("dp_shard", "encoder_dp_shard"):
            if getattr(self, name) == 0 or getattr(self, name) < -1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1, or -1 to "
                                 f"take the ranks the other axes leave")
        others = self.dp_replicate * self.sp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(f"dp_shard=-1: world_size={self.world_size} is not a multiple "
                                 f"of dp_replicate·sp·tp·pp = {others}")
            self.dp_shard = self.world_size // others
        if others * self.dp_shard != self.world_size:
            # ep is not a factor: experts borrow dp_shard·sp ranks (a common slip to count it).
            hint = f" (ep={self.ep} adds no ranks: it splits dp_shard·sp)" if self.ep > 1 else ""
            raise ValueError(f"dp_replicate·dp_shard·sp·tp·pp = {self.dp_replicate}·"
                             f"{self.dp_shard}·{self.sp}·{self.tp}·{self.pp} = "
                             f"{others * self.dp_shard}: must equal world_size="
                             f"{self.world_size}{hint}")
        if (self.dp_shard * self.sp) % self.ep:
            raise ValueError(f"ep={self.ep}: must divide dp_shard·sp = "
                             f"{self.dp_shard * self.sp} (experts borrow those ranks)")
        if self.pp > 1 and self.sp > 1:
            # The schedule runs every micro-batch inside one step() call, so no per-micro-batch
            # Ulysses layout (parallel.sequence.sp_batch) can reach the stages.
            raise ValueError(f"pp={self.pp} with sp={self.sp}: the pipeline runner carries no "
                             f"sequence-parallel layout per micro-batch; use one of them")
        if self.world_size % self.encoder_tp:
            raise ValueError(f"encoder_tp={self.encoder_tp}: must divide "
                             f"world_size={self.world_size}")
        if self.encoder_dp_shard == -1:
            self.encoder_dp_shard = self.world_size // self.encoder_tp
        if self.world_size % (self.encoder_dp_shard * self.encoder_tp):
            what = f"encoder_dp_shard={self.encoder_dp_shard}" if self.encoder_tp == 1 else \
                f"encoder_dp_shard·encoder_tp = {self.encoder_dp_shard}·{self.encoder_tp}"
            raise ValueError(f"{what}: must divide world_size={self.world_size}")

    # ---- derived sizes -------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Ranks that see different data (the global batch is split dp·sp ways by tokens)."""
        return self.dp_replicate * self.dp_shard

    @property
    def edp_shard(self) -> int:
        return self.dp_shard * self.sp // self.ep

    @property
    def encoder_dp_replicate(self) -> int:
        return self.world_size // (self.encoder_dp_shard * self.encoder_tp)

    @property
    def dp_sp(self) -> int:
        """Ranks holding different tokens: the data plane's ranks (dp_replicate·dp_shard·sp)."""
        return self.dp_replicate * self.dp_shard * self.sp

    def data_rank(self, rank: int) -> int:
        """Global `rank`'s index among the data plane's ranks (its `dp_sp` coordinate: TP and
        PP peers share one, since they train the same tokens)."""
        return (rank // self.tp) % self.dp_sp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def validate_for(self, config) -> None:
        """Checks against a `backbone.config.ModelConfig`: TP splits heads and FFN widths,
        Ulysses SP splits the heads TP leaves, EP splits experts, PP needs a layer a stage."""
        c = config
        if c.n_heads % self.tp or c.n_kv_heads % self.tp:
            raise ValueError(f"tp={self.tp}: must divide n_heads={c.n_heads} and "
                             f"n_kv_heads={c.n_kv_heads}")
        widths = {"ffn_dim": c.ffn_dim} if c.n_dense_layers or c.moe is None else {}
        if c.moe is not None and c.moe.shared_expert:
            widths["moe.shared_ffn_dim"] = c.moe.shared_dim
        for name, width in widths.items():
            if width % self.tp:
                raise ValueError(f"tp={self.tp}: must divide {name}={width}")
        heads, kv_heads = c.n_heads // self.tp, c.n_kv_heads // self.tp
        if heads % self.sp or kv_heads % self.sp:
            raise ValueError(f"sp={self.sp}: must divide the heads each tp rank holds "
                             f"(n_heads/tp={heads}, n_kv_heads/tp={kv_heads})")
        if self.ep > 1 and c.moe is None:
            raise ValueError(f"ep={self.ep}: the model has no MoE layers (moe is None)")
        if c.moe is not None and c.moe.num_experts % self.ep:
            raise ValueError(f"ep={self.ep}: must divide moe.num_experts={c.moe.num_experts}")
        if self.pp > c.n_layers:
            raise ValueError(f"pp={self.pp}: more stages than n_layers={c.n_layers}")
        if self.pp > 1 and c.tie_embeddings:
            raise ValueError(f"pp={self.pp}: tie_embeddings=True puts the LM head on stage 0; "
                             f"untie the embeddings to pipeline the model")
        encoders = {name: getattr(c, name, None) for name in ("vision", "audio")}
        encoders = {name: e for name, e in encoders.items() if e is not None}
        if self.pp > 1 and encoders:
            raise ValueError(f"pp={self.pp}: stage 0 takes token ids, so a model with encoders "
                             f"({', '.join(encoders)}) cannot be pipelined yet")
        for name, e in encoders.items():  # a dataclass, or a YAML run config's dict
            for field in ("n_heads", "ffn_dim"):
                value = e.get(field) if isinstance(e, dict) else getattr(e, field, None)
                if value is not None and value % self.encoder_tp:
                    raise ValueError(f"encoder_tp={self.encoder_tp}: must divide "
                                     f"{name}.{field}={value}")

    # ---- meshes --------------------------------------------------------------------------

    def _check_world(self) -> None:
        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(f"world_size={self.world_size}: the process group has "
                             f"{dist.get_world_size()} ranks")

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The backbone mesh (`BACKBONE_AXES`) with flattened `dp`, `dp_shard_sp`, `dp_sp`."""
        self._check_world()
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard,
                                              self.sp, self.tp), mesh_dim_names=BACKBONE_AXES)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
        mesh["dp_replicate", "dp_shard", "sp"]._flatten("dp_sp")
        return mesh

    def build_expert_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The same ranks seen by experts (`EXPERT_AXES`): `ep` is the inner part of
        dp_shard·sp, `edp_shard` the outer part that FSDP shards experts over."""
        self._check_world()
        return init_device_mesh(device_type, (self.pp, self.dp_replicate, self.edp_shard,
                                              self.ep, self.tp), mesh_dim_names=EXPERT_AXES)

    def build_encoder_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The encoders' own mesh over the whole world (`ENCODER_AXES`; `encoder_tp`
        innermost, so a TP group is adjacent ranks, as the backbone's is)."""
        self._check_world()
        return init_device_mesh(device_type, (self.encoder_dp_replicate, self.encoder_dp_shard,
                                              self.encoder_tp), mesh_dim_names=ENCODER_AXES)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP's view of a backbone, expert or encoder mesh: 1-D (shard) or, when the replicate
    axis is > 1, 2-D (replicate, shard) — HSDP, which `fully_shard` reads from a 2-D mesh."""
    names = mesh.mesh_dim_names or ()
    if "encoder_dp_shard" in names:
        pair = ("encoder_dp_replicate", "encoder_dp_shard")
    elif "edp_shard" in names:
        pair = ("dp_replicate", "edp_shard")
    else:
        pair = ("dp_replicate", "dp_shard_sp")
    return mesh[pair] if mesh[pair[0]].size() > 1 else mesh[pair[1]]
