"""What the live path needs from the training code of its rank: two small interfaces that
:mod:`ntp_megatron.training` implements, so that :mod:`ntp_megatron.elastic` never imports it.

- :class:`Builder` makes a rank's objects for a layout: the parallel setup of a topology, the model, DDP,
  optimizer and scheduler, the load of the checkpoint the run starts from, and the re-binding of kept objects to
  a new generation's groups.
- :class:`Training` is the loop's state a re-formation reads and sets: the objects it trains with, its progress,
  the iteration it voted on and has not stepped yet, and its :class:`Memory`.
- :class:`Memory` measures a rank's objects and emits its ``memory`` records; it also frees the gradient buffers
  a re-formation knows are dead, so that the old and the new objects never both hold them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

from ntp_megatron.plan.stages import JobTopology

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class RankObjects(Protocol):
    """The Megatron-Core objects a rank trains with in one layout."""

    model: DistributedDataParallel
    """The GPT model (``model.module``) in Megatron's DDP wrapper."""
    optimizer: MegatronOptimizer
    """``optimizer.optimizer`` is the torch optimizer whose state moves."""
    scheduler: OptimizerParamScheduler

    def param_gather(self) -> None:
        """Under the distributed optimizer: every rank's parameters from the shards (collective over the
        generation's groups the objects are bound to); nothing otherwise."""

    def shard_sources(self) -> list[tuple[int, list]]:
        """Under the distributed optimizer: (block, the buffers holding this rank's shard of it), per block served."""

    adopted: dict[int, frozenset[int]]
    """Block -> the ids of the optimizer's main parameters whose shard state came by reference from the objects
    these were built beside (``Builder.build``'s ``adopt_from``), with the buffers that hold the block."""

    def release(self) -> None:
        """Drop what the objects hold beyond themselves (they were replaced)."""

    def settle(self) -> None:
        """The formation they were built for completed: they let go of the objects they adopted from."""

    def discard(self) -> None:
        """Drop objects built for a formation that did not complete: what they took over from ``adopt_from``
        goes back to it."""


class Builder(Protocol):
    def setup(self, topology: JobTopology, rank: int, pool: Any) -> Any:
        """The parallel setup of ``rank`` in ``topology``: its groups (collective over each group's members;
        ``pool``, a :class:`ntp_megatron.core.groups.GroupPool`, offers those kept from the generation before and
        records what was made), the samples it reads. Opaque here: handed back to :meth:`build` and
        :meth:`rebind`."""

    def build(self, setup: Any, initialize: bool, adopt_from: Optional[RankObjects] = None) -> RankObjects:
        """Fresh objects for ``setup``'s layout; ``initialize`` draws the initial weights (a function of the
        seed alone), else the caller fills them. ``adopt_from``: the objects the rank holds now; the new ones may
        take over buffers of theirs that hold what they would hold (under the distributed optimizer: a block's
        buckets and its shard state), rather than a second copy (``RankObjects.adopted``)."""

    def load_start(self, objects: RankObjects) -> int:
        """Read the checkpoint the run starts from (``checkpoint.load``) into ``objects``; returns its iteration.
        Collective over the generation."""

    def rebind(self, objects: RankObjects, setup: Any) -> None:
        """Point kept objects at ``setup``'s process groups (the layout is unchanged; the groups are new)."""


class Memory(Protocol):
    def begin(self) -> None:
        """A phase begins (a re-formation): its peak is measured from here."""

    def sample(self, *held: Optional[RankObjects], transient: int = 0) -> int:
        """A sample point of the phase: the objects held now (None ignored) and ``transient`` bytes of messages;
        returns their bytes."""

    def report(self, phase: str, objects: RankObjects, **fields: Any) -> dict:
        """Emit the phase's ``memory`` record for ``objects`` (with ``fields``)."""

    def free_gradients(self, objects: RankObjects) -> int:
        """Free the storage of the objects' gradient buffers (dead); returns the bytes freed."""

    def restore_gradients(self, objects: RankObjects) -> None:
        """Re-allocate, zeroed, what :meth:`free_gradients` freed (nothing if nothing was)."""

    def free_parameters(self, objects: RankObjects) -> int:
        """Free the storage of the objects' model parameters (dead: the objects are never trained with again);
        returns the bytes freed."""


class Training(Protocol):
    parts: Optional[RankObjects]
    """The objects the loop trains with; None in a process that has not formed a generation yet."""
    iteration: int
    """Completed iterations."""
    consumed_samples: int
    memory: Memory

    def pending_iteration(self) -> Optional[int]:
        """The iteration this rank voted on and has not stepped, if any."""

    def settle(self, committed: bool) -> None:
        """Step and report the pending iteration (``committed``: the decision was commit), or drop it."""
