""""A peer died: get out, then make new groups", one interface with a backend per communication library.

What the groups are is decided from the topologies alone (:mod:`ntp_megatron.plan.group_plan`); what to cut when a
generation ends, and how, is the backend's (:meth:`GroupBackend.cut_at_end`, :meth:`GroupBackend.get_out`); the
groups the next generation shares go on if their members agree, the others are let go of
(:meth:`GroupBackend.let_go`); new groups are made fresh.

- **gloo** (what runs here): gloo cannot abort a collective, so getting out is shutting down sockets — the
  generation's own (store client, default group) and those of every group with a dead member: every wait on them
  fails at once (:mod:`ntp_megatron.elastic.watchdog`). A group without a dead member is left as it is, so it can
  go on; a rank blocked in it gives its wait up through the wait escape
  (:mod:`ntp_megatron.patches.torch_distributed_work`), and its members' verdict tells whether anything was left
  half-matched in it. Letting go is shutting down and holding the group until gloo's threads are idle.
- **NCCL** (written, never run: no GPU here): error handling that does not take the process down
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: the watchdog here, not torch's, decides what to abort) and non-blocking
  communicators (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``, so an abort does not wait on a blocked kernel). A host
  blocked on an NCCL kernel waits in a stream synchronisation that no Python escape reaches, and a group without a
  dead member can hold such a kernel (half-matched: its peer in the failed replica left); so when a rank dies, the
  communicators of the default group and of every group are aborted, and every group is made fresh. Groups go on
  only across a planned move (an admission at an iteration boundary: nothing in flight). Not used yet:
  ``torch.distributed.shrink_group`` (it needs its survivors to agree before it, which only a handshake like the
  members' verdict could give, a default group bound to a device, which the groups made by their members alone
  forbid, and a parent not aborted or the abort flag that hangs from NCCL 2.31, pytorch#194679). A CUDA error that
  sticks to the device makes the rank count as dead (:func:`ntp_megatron.elastic.errors.is_device_lost`).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Protocol, Sequence

from ntp_megatron.plan.group_plan import GroupKey, Identity, blocked_by
from ntp_megatron.sockets import shutdown_sockets

logger = logging.getLogger(__name__)


class GroupBackend(Protocol):
    name: str

    def environment(self) -> dict[str, str]:
        """What a rank's environment must say before torch.distributed starts."""

    def cut_at_end(self, groups: Iterable[GroupKey], dead: Optional[set[Identity]]) -> list[GroupKey]:
        """The groups to cut the moment a generation ends, given the dead its abort key names (None: unknown, cut
        everything; empty: a planned move)."""

    def get_out(self, groups: Sequence, own_sockets: dict[int, str], default_group) -> int:
        """Make every wait on ``groups`` (:class:`ntp_megatron.core.groups.PooledGroup`), on the generation's own
        connections and on its default group end now; returns how many things it cut."""

    def let_go(self, groups: Sequence) -> list:
        """``groups`` do not go on: cut them; returns the process groups to hold until idle."""


class GlooBackend:
    name = "gloo"

    def environment(self) -> dict[str, str]:
        return {}

    def cut_at_end(self, groups: Iterable[GroupKey], dead: Optional[set[Identity]]) -> list[GroupKey]:
        groups = list(groups)
        return groups if dead is None else blocked_by(groups, dead)

    def get_out(self, groups: Sequence, own_sockets: dict[int, str], default_group) -> int:
        # The default group's sockets are among the generation's own (opened while it was made).
        return shutdown_sockets(own_sockets) + sum(shutdown_sockets(pooled.sockets) for pooled in groups)

    def let_go(self, groups: Sequence) -> list:
        for pooled in groups:
            shutdown_sockets(pooled.sockets)
        return [pooled.group for pooled in groups]  # gloo's threads may still be in them: held until idle


class NcclBackend:
    """Written against torch 2.13's ProcessGroupNCCL; never run (no GPU here). See the module docstring."""

    name = "nccl"

    def environment(self) -> dict[str, str]:
        return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
                "TORCH_NCCL_BLOCKING_WAIT": "0"}

    def cut_at_end(self, groups: Iterable[GroupKey], dead: Optional[set[Identity]]) -> list[GroupKey]:
        return [] if dead is not None and not dead else list(groups)  # kept only across a planned move

    def get_out(self, groups: Sequence, own_sockets: dict[int, str], default_group) -> int:
        cut = shutdown_sockets(own_sockets)  # the store client: a store wait of the generation ends too
        for group in ([default_group] if default_group is not None else []) + [pooled.group for pooled in groups]:
            cut += _abort(group)
        return cut

    def let_go(self, groups: Sequence) -> list:
        for pooled in groups:
            _abort(pooled.group)
        return []  # an aborted communicator holds no thread that a destructor would wait for


def _abort(group) -> int:
    try:
        group.abort()
        return 1
    except Exception as exc:  # noqa: BLE001 - aborted already, or destroyed: nothing is blocked in it
        logger.debug("abort of a process group: %s", exc)
        return 0


def backend_for(name: str) -> GroupBackend:
    if name == "gloo":
        return GlooBackend()
    if name == "nccl":
        return NcclBackend()
    raise ValueError(f"parallel.backend {name!r}: live re-formation knows 'gloo' and 'nccl'")
