""""A peer died: get out, then make new groups", one interface with a backend per communication library.

What to do is decided from the topologies alone (:mod:`ntp_megatron.group_plan`): the moment a generation ends,
every wait on a group with a dead member must end (:meth:`GroupBackend.get_out`); when the next forms, the groups
it shares with the one before go on if their members agree, the others are let go of
(:meth:`GroupBackend.let_go`), and the new ones are made — fresh, or on NCCL by shrinking a group that only lost
members (:func:`shrink_plan`). How is the backend's:

- **gloo** (what runs here): gloo cannot abort a collective, so getting out is shutting down the group's sockets
  (every wait on them fails at once; :mod:`ntp_megatron.elastic.watchdog`), letting go is that and holding the
  group until gloo's threads are idle, and a group is always made fresh.
- **NCCL** (written, never run: no GPU here): error handling that does not take the process down
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: the watchdog here, not torch's, decides what to abort), non-blocking
  communicators (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``, so an abort does not wait on a blocked kernel), getting out
  by aborting exactly the communicators of the blocked groups (``ProcessGroup.abort``), and new groups by
  ``torch.distributed.shrink_group`` where NCCL offers it (ncclCommShrink, NCCL ≥ 2.27) and the group only lost
  members — with its abort flag only below NCCL 2.31, where pytorch#194679 is a known hang — else fresh. Pipeline
  point-to-point goes through ``batch_isend_irecv`` on the group's communicator. A CUDA error that sticks to the
  device (an illegal address, an ECC error) leaves nothing to recover in the process: the rank counts as dead
  (:func:`ntp_megatron.elastic.errors.is_device_lost`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence

from ntp_megatron.group_plan import GroupKey, Identity
from ntp_megatron.sockets import shutdown_sockets

logger = logging.getLogger(__name__)

SHRINK_SINCE = (2, 27)
"""ncclCommShrink first appears in NCCL 2.27."""
SHRINK_ABORT_HANGS_SINCE = (2, 31)
"""From NCCL 2.31 a shrink with the abort flag can hang (pytorch#194679): a group with a blocked collective is made
fresh there."""


@dataclass(frozen=True)
class Shrink:
    """Make ``key`` by shrinking ``parent`` (held by this rank) without ``excluded`` (its members that left)."""

    key: GroupKey
    parent: GroupKey
    excluded: tuple[Identity, ...]
    abort: bool
    """The parent can have a collective in flight (a member died): shrink with NCCL's abort flag."""


def shrink_plan(held: Iterable[GroupKey], wanted: Iterable[GroupKey], dead: Iterable[Identity],
                nccl_version: Optional[tuple[int, ...]]) -> dict[GroupKey, Shrink]:
    """Which of the ``wanted`` groups this rank does not hold can be made by shrinking one it holds: a group of the
    same role and place whose members are the wanted group's plus some that left, in the same order (NCCL's shrink
    keeps the survivors' order). Only where NCCL has the shrink (``nccl_version`` ≥ 2.27; None: no NCCL), and a
    parent with a dead member (a collective may be blocked in it) only where the abort flag does not hang (< 2.31).
    Pure: every member of a group computes the same plan for it."""
    if nccl_version is None or tuple(nccl_version[:2]) < SHRINK_SINCE:
        return {}
    held = list(held)
    held_keys = set(held)
    dead = set(dead)
    out: dict[GroupKey, Shrink] = {}
    for key in wanted:
        if key in held_keys:
            continue
        for parent in held:
            if (parent.role, parent.place) != (key.role, key.place) or len(parent.members) <= len(key.members):
                continue
            survivors = tuple(m for m in parent.members if m in set(key.members))
            if survivors != key.members:
                continue
            abort = parent.has_member(dead)
            if abort and tuple(nccl_version[:2]) >= SHRINK_ABORT_HANGS_SINCE:
                continue
            out[key] = Shrink(key, parent, tuple(m for m in parent.members if m not in set(key.members)), abort)
            break
    return out


class GroupBackend(Protocol):
    name: str

    def environment(self) -> dict[str, str]:
        """What a rank's environment must say before torch.distributed starts."""

    def get_out(self, groups: Sequence, own_sockets: dict[int, str]) -> int:
        """Make every wait on ``groups`` (:class:`ntp_megatron.groups.PooledGroup`) and on the generation's own
        connections end now; returns how many things it cut."""

    def let_go(self, groups: Sequence) -> list:
        """``groups`` do not go on: cut them; returns the process groups to hold until idle."""


class GlooBackend:
    name = "gloo"

    def environment(self) -> dict[str, str]:
        return {}

    def get_out(self, groups: Sequence, own_sockets: dict[int, str]) -> int:
        return shutdown_sockets(own_sockets) + sum(shutdown_sockets(pooled.sockets) for pooled in groups)

    def let_go(self, groups: Sequence) -> list:
        for pooled in groups:
            shutdown_sockets(pooled.sockets)
        return [pooled.group for pooled in groups]  # gloo's threads may still be in them: held until idle


class NcclBackend:
    """Written against torch 2.13's ProcessGroupNCCL; never run (no GPU here). See the module docstring."""

    name = "nccl"

    def __init__(self, default_group_getter=None) -> None:
        self._default_group = default_group_getter

    def environment(self) -> dict[str, str]:
        return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
                "TORCH_NCCL_BLOCKING_WAIT": "0"}

    def get_out(self, groups: Sequence, own_sockets: dict[int, str]) -> int:
        cut = 0
        default = self._default_group() if self._default_group is not None else None
        for group in ([default] if default is not None else []) + [pooled.group for pooled in groups]:
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
        from torch.distributed import distributed_c10d

        return NcclBackend(lambda: distributed_c10d.GroupMember.WORLD)
    raise ValueError(f"parallel.backend {name!r}: live re-formation knows 'gloo' and 'nccl'")


def shrink_into(groups: dict, shrinks: dict[GroupKey, Shrink], generation: int, shrink_group=None) -> dict:
    """Make the groups of ``shrinks`` from the parents in ``groups`` (key -> :class:`ntp_megatron.groups.PooledGroup`)
    with ``torch.distributed.shrink_group`` (collective over each parent's survivors: every one of them runs the same
    plan, in key order); returns them as pooled groups of ``generation``, to be carried like the groups that go on.
    A shrink that fails leaves that group to be made fresh (its members' verdict sees this rank hold none)."""
    from ntp_megatron.groups import PooledGroup

    if shrink_group is None:
        import torch.distributed as dist

        shrink_group = dist.shrink_group
    flags = {False: 0x00, True: 0x01}  # torch.distributed's SHRINK_DEFAULT, SHRINK_ABORT
    out = {}
    for key in sorted(shrinks):
        plan = shrinks[key]
        parent = groups[plan.parent]
        excluded = [parent.key.members.index(m) for m in plan.excluded]  # group ranks of the parent
        try:
            group = shrink_group(excluded, group=parent.group, shrink_flags=flags[plan.abort])
        except Exception as exc:  # noqa: BLE001 - made fresh instead
            logger.warning("shrinking %s into %s failed (%s): made fresh", plan.parent.label(), key.label(), exc)
            continue
        out[key] = PooledGroup(key=key, group=group, made_in=generation, sockets={})
    return out
