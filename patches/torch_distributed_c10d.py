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

A gloo group's connect that an ended generation can cut short (:class:`EscapableGloo`, :func:`apply_connect_escape`).
torch makes a gloo group (``init_process_group``, ``new_group``) by constructing ``ProcessGroupGloo``, whose
full-mesh connect publishes this rank's address in the store, reads every member's, then connects the pairs one by
one. A member that dies after publishing its address leaves the members that listen for its connection waiting
for ``5 x`` the group's timeout (gloo's connect timeout; measured: 20 s for a 4 s group), and a member that fails
fast on it (its connect refused) leaves its own listeners waiting the same way. No socket of the process is blocked
in that wait, so shutting the generation's sockets down (its watchdog) does not reach it. With an escape installed
(:mod:`ntp_megatron.patches.torch_distributed_work`), the constructor runs in a helper thread and the caller waits in
50 ms slices, giving the connect up (:class:`~ntp_megatron.patches.torch_distributed_work.CollectiveAbandoned`) once
its generation is over; the helper ends at gloo's timeout, held like an abandoned wait.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from ntp_megatron import phases
from ntp_megatron.patches import torch_distributed_work
from ntp_megatron.patches.torch_distributed_work import AbandonedWait, CollectiveAbandoned

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


# -- the connect escape ---------------------------------------------------------------------------------------------

_UpstreamGloo = getattr(distributed_c10d, "ProcessGroupGloo", None)
"""torch's class (None without gloo); :func:`apply_connect_escape` puts :class:`EscapableGloo` in its place in
``distributed_c10d``, where ``_new_process_group_helper`` constructs it."""

CONNECT_POINT = "connect"
"""The phase point (:func:`ntp_megatron.phases.point`) a connect still under way after its first slice reaches: the
rank's address is published by then and its peers may be connecting to it (``--inject-failure ...,phase=connect``)."""


def _connect(group: Any, args: tuple, kwargs: dict, escape: torch_distributed_work.Escape,
             point: Callable[[str], None]) -> None:
    """Construct ``group`` (upstream's ``ProcessGroupGloo.__init__``) in a helper thread, waiting for it in slices
    until it is done or its generation is over; ``point`` is called once, after the first slice."""
    outcome: dict[str, BaseException] = {}

    def construct() -> None:
        try:
            _UpstreamGloo.__init__(group, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc

    helper = threading.Thread(target=construct, name="ntp-gloo-connect", daemon=True)
    was = phases.current()[1]
    slices = 0
    with phases.waiting():
        helper.start()
        while True:
            helper.join(torch_distributed_work.SLICE.total_seconds())
            if not helper.is_alive():
                break
            slices += 1
            if slices == 1:
                point(CONNECT_POINT)
                phases.enter(was)  # a connect is part of the activity it serves, for reports
            reason = escape.reason()
            if reason is not None:
                escape.abandoned(AbandonedWait(None, helper, what="gloo's connect of a process group"))
                raise CollectiveAbandoned(f"gloo's connect of a process group given up: {reason}")
    if "error" in outcome:
        raise outcome["error"]


if _UpstreamGloo is not None:
    class EscapableGloo(_UpstreamGloo):
        """``ProcessGroupGloo`` whose construction (the full-mesh connect) an ended generation can cut short: with an
        escape installed it runs in a helper thread (:func:`_connect`), else as upstream's. A subclass, so that torch's
        ``isinstance`` checks and the class's static members hold."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            escape = torch_distributed_work.current_escape()
            if escape is None:
                _UpstreamGloo.__init__(self, *args, **kwargs)
            else:
                _connect(self, args, kwargs, escape, phases.point)


def apply_connect_escape() -> None:
    """Make torch construct gloo groups as :class:`EscapableGloo` (a torch this was not written for, or one without
    gloo, keeps upstream's)."""
    if _UpstreamGloo is None or not torch.__version__.startswith(TESTED_TORCH):
        return
    distributed_c10d.ProcessGroupGloo = EscapableGloo
