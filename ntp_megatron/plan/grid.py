"""Megatron-Core's dense rank grid with pipeline stages: pure arithmetic, no torch.

Megatron numbers ranks in the order ``tp-cp-ep-dp-pp`` (``parallel_state.initialize_model_parallel``'s
``RankGenerator``): the tensor-parallel slot fastest, then the replica (data parallel), then the stage. A stage is
therefore one contiguous block of ``tp × dp`` ranks, and ``rank = stage·tp·dp + replica·tp + slot``. With context
and expert parallelism 1, a rank's groups are:

- its TP group: its stage of its replica (``tp`` consecutive ranks);
- its DP group: its slot of its stage, one rank per replica;
- its pipeline *lane* (Megatron's pipeline group): its slot of its replica, one rank per stage; the schedule sends
  activations along it, TP rank ``i`` of stage ``p`` to TP rank ``i`` of stage ``p + 1``;
- its model-parallel group: every stage and slot of its replica (``tp × pp`` ranks: the grad norm's group);
- the embedding group: the first and the last rank of its lane (where the tied word embeddings live), for the ranks
  of the first and the last stage only; the position-embedding group: the first stage's rank of the lane, alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    """The dense ``tp × dp × pp`` grid of one job (every slot live)."""

    tp: int
    dp: int
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")

    @classmethod
    def of_world(cls, tp: int, pp: int, world_size: int) -> "Grid":
        """The grid of ``world_size`` ranks at ``tp`` and ``pp`` (the data-parallel size is what is left)."""
        if tp < 1 or pp < 1 or world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not a multiple of tensor × pipeline model parallel size "
                             f"{tp} × {pp}")
        return cls(tp, world_size // (tp * pp), pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def rank(self, stage: int, replica: int, slot: int) -> int:
        return (stage * self.dp + replica) * self.tp + slot

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(stage, replica, slot)`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        rest, slot = divmod(rank, self.tp)
        stage, replica = divmod(rest, self.dp)
        return stage, replica, slot

    def tp_ranks(self, stage: int, replica: int) -> tuple[int, ...]:
        return tuple(self.rank(stage, replica, s) for s in range(self.tp))

    def dp_ranks(self, stage: int, slot: int) -> tuple[int, ...]:
        return tuple(self.rank(stage, r, slot) for r in range(self.dp))

    def lane(self, replica: int, slot: int) -> tuple[int, ...]:
        """The pipeline group of slot ``slot`` of replica ``replica``: one rank per stage, in stage order."""
        return tuple(self.rank(p, replica, slot) for p in range(self.pp))

    def mp_ranks(self, replica: int) -> tuple[int, ...]:
        """Every rank of replica ``replica`` (all stages, all slots): Megatron's model-parallel group."""
        return tuple(self.rank(p, replica, s) for p in range(self.pp) for s in range(self.tp))

    def embedding_ranks(self, replica: int, slot: int) -> tuple[int, ...]:
        """The first and the last rank of a lane (one rank at PP 1): Megatron's embedding group."""
        lane = self.lane(replica, slot)
        return tuple(sorted({lane[0], lane[-1]}))

    def tp_per_replica(self) -> list:
        """Every replica's TP degree as the records give it: one number per replica, or with stages one per stage."""
        return [self.tp if self.pp == 1 else [self.tp] * self.pp for _ in range(self.dp)]

    def partition(self, key) -> list[tuple[int, ...]]:
        """The world cut into groups of equal ``key(stage, replica, slot)``, each in rank order."""
        parts: dict = {}
        for rank in range(self.world_size):
            parts.setdefault(key(*self.coords(rank)), []).append(rank)
        return [tuple(ranks) for ranks in parts.values()]
