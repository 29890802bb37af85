"""The parallel degrees of one server and the device mesh they describe.

Ranks form a ``(dp, sp)`` grid in row-major order: rank ``r`` is in data-parallel group
``r // sp`` at sequence-parallel position ``r % sp``. Every group scores its own rows; the
ranks of a group split each row along tokens (Ulysses). With ``fsdp`` the parameters are
sharded over the whole world (the ``dp`` and ``sp`` axes flattened, see ``parallelize``).

``ParallelDims`` validates the degrees and answers layout questions without a process group;
only ``build_mesh`` needs ``torch.distributed`` to be initialised.
"""

from __future__ import annotations

from dataclasses import dataclass

MESH_AXES = ("dp", "sp")
FSDP_AXIS = "dp_sp"  # name of the flattened (dp, sp) axis that FSDP shards over


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism: ``dp`` groups of ``sp`` ranks each, ``dp * sp == world_size``.

    Example:
        >>> dims = ParallelDims.from_world(world_size=4, sp=2, fsdp=True)
        >>> dims.dp, dims.group_of(3), dims.sp_rank(3), dims.ranks_of_group(1)
        (2, 1, 1, (2, 3))
    """

    dp: int
    sp: int
    world_size: int
    fsdp: bool = False

    def __post_init__(self):
        for name in ("dp", "sp", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {name}({value})")
        if self.dp * self.sp != self.world_size:
            raise ValueError(f"dp({self.dp}) * sp({self.sp}) != world_size({self.world_size})")
        if not isinstance(self.fsdp, bool):
            raise TypeError(f"fsdp must be a bool, got {type(self.fsdp).__name__} {self.fsdp!r}")

    @staticmethod
    def from_world(world_size: int, sp: int = 1, fsdp: bool = False) -> "ParallelDims":
        """Derives ``dp`` from the world size; says which division fails when it does not."""
        for name, value in (("world_size", world_size), ("sp", sp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}({value!r})")
        if world_size % sp:
            raise ValueError(
                f"world_size({world_size}) is not divisible by sp({sp}): "
                f"world_size({world_size}) % sp({sp}) = {world_size % sp}"
            )
        return ParallelDims(dp=world_size // sp, sp=sp, world_size=world_size, fsdp=fsdp)

    # Layout (no process group needed).

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank({rank}) is outside [0, world_size({self.world_size}))")

    def group_of(self, rank: int) -> int:
        """The data-parallel group that ``rank`` belongs to."""
        self._check_rank(rank)
        return rank // self.sp

    def sp_rank(self, rank: int) -> int:
        """Position of ``rank`` inside its group: which token shard of a row it holds."""
        self._check_rank(rank)
        return rank % self.sp

    def ranks_of_group(self, group: int) -> tuple[int, ...]:
        if not 0 <= group < self.dp:
            raise ValueError(f"group({group}) is outside [0, dp({self.dp}))")
        return tuple(range(group * self.sp, (group + 1) * self.sp))

    @property
    def lockstep(self) -> bool:
        """Whether every rank of the world must run every forward together.

        FSDP shards over the whole world, so its per-layer all-gathers involve every rank; without
        it only the ranks of one group exchange anything (the Ulysses all-to-all).
        """
        return self.fsdp and self.world_size > 1

    def row_token_budget(self, max_batch_tokens: int) -> int:
        """Tokens one row of a group may hold: each of its ``sp`` ranks holds ``max_batch_tokens``."""
        return self.sp * int(max_batch_tokens)

    def as_info(self) -> dict:
        """What /v1/models and the metrics show as ``parallel``."""
        return {"world_size": self.world_size, "dp": self.dp, "sp": self.sp, "fsdp": self.fsdp}

    # Mesh (needs an initialised default process group).

    def build_mesh(self, device_type: str):
        """The ``("dp", "sp")`` device mesh over all ranks; ``device_type`` is "cpu" or "cuda".

        The sp axis gives each group's all-to-all process group. With ``fsdp`` the flattened
        ``dp_sp`` axis (every rank) is created too, so that every rank builds it collectively.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("build_mesh needs torch.distributed to be initialised first")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks but world_size({self.world_size}) was configured"
            )
        mesh = init_device_mesh(device_type, (self.dp, self.sp), mesh_dim_names=MESH_AXES)
        if self.fsdp:
            self.fsdp_mesh(mesh)  # creating its process group is collective: do it on every rank now
        return mesh

    def fsdp_mesh(self, mesh):
        """The 1-D mesh FSDP shards over: ``dp`` and ``sp`` flattened, i.e. every rank."""
        if not self.fsdp:
            raise ValueError("fsdp_mesh asked for, but fsdp is off")
        # DeviceMesh has no public flatten yet; _flatten (what torchtitan uses for the same job)
        # creates the flattened mesh once and returns the same one on later calls.
        return mesh._flatten(FSDP_AXIS)
