"""Process groups that outlive the default group they were made under (upstream: ``torch.distributed``'s
``distributed_c10d``; written against torch 2.13).

An elastic generation re-makes the default group (new world size, ranks numbered anew), and torch's
``destroy_process_group()`` of the default group shuts down and forgets every group of the process. A group
that a failure did not touch (a healthy replica's tensor-parallel group) should go on as the same object with
the same communicator. torch keeps what it knows of a group in private tables (``_world``: the backend and store,
the name, global-to-group ranks, the backend config, tags; plus the C++ registry of names that functional
collectives resolve): :func:`detach` takes a group out of them before the default group goes, without shutting it
down; :func:`attach` puts it back under the next default group with its members' new global ranks, counted as
torch counts a group it makes itself, so that later groups are named alike on every rank (see
:class:`ntp_megatron.core.groups.GroupMaker`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

TESTED_TORCH = ("2.13.",)


def supported() -> bool:
    """Whether this torch is the one these helpers were written for (its private tables are not an interface):
    elsewhere every group is made anew in every generation (``ntp.keep_groups`` has no effect)."""
    return torch.__version__.startswith(TESTED_TORCH) and all(
        hasattr(distributed_c10d, name) for name in ("_register_pg_in_world", "_unregister_process_group", "_world"))


def check_torch_version() -> None:
    if not supported():
        raise RuntimeError(f"keeping process groups across generations touches torch.distributed's private tables, "
                           f"written for torch {', '.join(v + 'x' for v in TESTED_TORCH)}; this is torch "
                           f"{torch.__version__}")


@dataclass
class Detached:
    """A group taken out of torch's tables, with what :func:`attach` needs to put it back."""

    group: dist.ProcessGroup
    name: str
    backend: str
    store: dist.Store
    backend_config: str
    tag: Optional[str]
    in_default_tag: bool
    """Listed under torch's default tag ``""`` too (as every group ``new_group`` makes is)."""


def detach(group: dist.ProcessGroup) -> Detached:
    """Take ``group`` out of torch's tables without shutting it down: a later ``destroy_process_group()`` leaves
    it alone, and it answers no query (its ranks, its name) until :func:`attach`."""
    check_torch_version()
    world = distributed_c10d._world
    backend, store = world.pg_map.pop(group)
    name = world.pg_names.pop(group)
    config = world.pg_backend_config.pop(group)
    world.pg_group_ranks.pop(group, None)
    world.pg_coalesce_state.pop(group, None)
    tag = world.pg_to_tag.pop(group, None)
    in_default = group in world.tags_to_pg.get("", [])
    for members in world.tags_to_pg.values():
        while group in members:
            members.remove(group)
    distributed_c10d._unregister_process_group(name)
    return Detached(group=group, name=name, backend=backend, store=store, backend_config=config, tag=tag,
                    in_default_tag=in_default)


def attach(detached: Detached, global_ranks: Mapping[int, int], counted: bool) -> dist.ProcessGroup:
    """Register a detached group under the current default group: ``global_ranks`` maps each member's new global
    rank to its (unchanged) group rank. ``counted``: the group stands for one torch would have named by its
    counter (made by every rank, ``use_local_synchronization=False``), so the counter moves on as it would have."""
    check_torch_version()
    world = distributed_c10d._world
    if detached.group in world.pg_map:
        raise RuntimeError(f"process group {detached.name} is attached already")
    distributed_c10d._register_pg_in_world(detached.group, backend_name=detached.backend, store=detached.store,
                                           group_name=detached.name, backend_config=detached.backend_config,
                                           rank_mapping=dict(global_ranks), pg_tag=detached.tag,
                                           add_to_default_tag=detached.in_default_tag)
    if counted:
        world.group_count += 1
    return detached.group
