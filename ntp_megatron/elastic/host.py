"""What the live path needs from the training code of its rank: two small interfaces that
:mod:`ntp_megatron.training` implements, so that :mod:`ntp_megatron.elastic` never imports it.

- :class:`Builder` makes a rank's objects for a layout: the parallel setup of a topology, the model, DDP,
  optimizer and scheduler, the load of the checkpoint the run starts from, and the re-binding of kept objects to
  a new generation's groups.
- :class:`Training` is the loop's state a re-formation reads and sets: the objects it trains with, its progress,
  and the iteration it voted on and has not stepped yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

from ntp_megatron.layout import Topology

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

    def release(self) -> None:
        """Drop what the objects hold beyond themselves (they were replaced)."""


class Builder(Protocol):
    def setup(self, topology: Topology, rank: int) -> Any:
        """The parallel setup of ``rank`` in ``topology``: its groups (collective over each group's members),
        the samples it reads. Opaque here: handed back to :meth:`build` and :meth:`rebind`."""

    def build(self, setup: Any, initialize: bool) -> RankObjects:
        """Fresh objects for ``setup``'s layout; ``initialize`` draws the initial weights (a function of the
        seed alone), else the caller fills them."""

    def load_start(self, objects: RankObjects) -> int:
        """Read the checkpoint the run starts from (``checkpoint.load``) into ``objects``; returns its iteration.
        Collective over the generation."""

    def rebind(self, objects: RankObjects, setup: Any) -> None:
        """Point kept objects at ``setup``'s process groups (the layout is unchanged; the groups are new)."""


class Training(Protocol):
    parts: Optional[RankObjects]
    """The objects the loop trains with; None in a process that has not formed a generation yet."""
    iteration: int
    """Completed iterations."""
    consumed_samples: int

    def pending_iteration(self) -> Optional[int]:
        """The iteration this rank voted on and has not stepped, if any."""

    def settle(self, committed: bool) -> None:
        """Step and report the pending iteration (``committed``: the decision was commit), or drop it."""
