"""A rank's membership in the job's generations (rank side of :mod:`ntp_megatron.elastic`).

A process keeps one identity for the whole run, its *launch rank*, and with it a fixed (replica, slot).
Generation ``g`` gives it a process-group rank (``topology.rank_of(replica, slot)``), a default process group on
the store prefix ``gen<g>/``, the NTP groups, a store client of its own and a watchdog. When the controller ends
a generation, the watchdog closes that generation's own sockets and those of every group with a dead member;
:meth:`ElasticRank.leave` then takes the groups the next generation shares with this one out of torch's tables
(they may go on, :mod:`ntp_megatron.plan.group_plan`) and drops every reference to the rest (torch.distributed's
groups, Megatron's globals, the client), so threads, file descriptors and memory return to where they were
before it was joined, but for the groups that go on. When the next generation forms, :meth:`ElasticRank.offer`
asks their members whether they go on; those that do are drained (:meth:`ElasticRank.drain_kept`) and kept.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d
from megatron.core import parallel_state

from ntp_megatron.config import timing
from ntp_megatron.elastic import group_backend, keys, publication
from ntp_megatron.elastic.commit import CommitProtocol, NodeShare, note_aware
from ntp_megatron.elastic.watchdog import GenerationWatchdog, Heartbeat, StoreFactory
from ntp_megatron.plan.group_plan import GroupKey, Offer, keep_verdict
from ntp_megatron.core.groups import GroupPool, PooledGroup
from ntp_megatron.sockets import SocketScope, connections_to, socket_fds
from ntp_megatron.patches import torch_distributed_work
from ntp_megatron.patches.torch_distributed_work import AbandonedWait
from ntp_megatron.plan.stages import JobTopology

logger = logging.getLogger(__name__)



class JobStopped(SystemExit):
    """The launcher stopped the job (a failure NTP cannot absorb, a rank's own error): this process ends."""


@dataclass
class Generation:
    topology: JobTopology
    rank: int
    """This process's rank in the generation (its default group)."""
    commit: CommitProtocol
    watchdog: GenerationWatchdog
    store: Optional[dist.Store]
    """The generation's own store client (the default group's rendezvous); dies with the generation (or with the
    last group made in it that went on)."""
    pool: GroupPool = None  # type: ignore[assignment]
    """Its process groups, made or kept (filled by the caller's :func:`ntp_megatron.core.groups.build_groups`)."""

    @property
    def number(self) -> int:
        return self.topology.generation


@dataclass(frozen=True)
class NodePlane:
    """A job on several nodes: the two-level control plane (:mod:`ntp_megatron.elastic.relay`). This process votes,
    beats and waits for generations in its node's store; the root store (node 0's) keeps what is rare or read across
    nodes."""

    open_node: StoreFactory
    """Opens clients of this node's store (on node 0 the root store itself)."""
    port: int
    """The port of this node's store."""
    node: int
    """This process's node."""
    node_of: tuple[int, ...]
    """Launch rank -> its node (:func:`ntp_megatron.plan.placement.launch_nodes`)."""
    min_tp: int = 1
    policy: str = "drop_replica"
    """``ntp.min_tp`` and ``ntp.on_unrecoverable``: with them a rank computes a new generation's topology from what
    its publication says changed, as the controller did (:func:`ntp_megatron.elastic.publication.computed`)."""

    def first_on_node(self, topology: JobTopology, identities: dict[int, tuple[int, ...]], launch_rank: int) -> bool:
        """Whether ``launch_rank`` is the first live launch rank of this node in ``topology``."""
        return launch_rank == min(lr for lr, identity in identities.items()
                                  if self.node_of[lr] == self.node and topology.rank_of(*identity) is not None)

    def share(self, topology: JobTopology, identities: dict[int, tuple[int, ...]]) -> NodeShare:
        """Where this process counts in ``topology``'s generation (``identities``: launch rank -> identity)."""
        live = [self.node_of[lr] for lr, identity in identities.items() if topology.rank_of(*identity) is not None]
        return NodeShare(members=live.count(self.node), nodes=len(set(live)))


TOPOLOGIES_KEPT = 8
"""Topologies a process keeps to compute the next ones from (the base of a new generation is the newest completed
one, a few generations back at most)."""


class ElasticRank:
    """This process in an elastic NTP job: its identity, its control-plane store clients, its heartbeat."""

    def __init__(self, launch_rank: int, open_store: StoreFactory, backend: str, timeout_s: float,
                 heartbeat_s: float, nodes: Optional[NodePlane] = None, root_port: Optional[int] = None) -> None:
        """``root_port``: the root store's (for :meth:`store_connections`)."""
        self.launch_rank = launch_rank
        self.root_port = root_port
        self.open_store = open_store
        self.backend = backend
        self.group_backend = group_backend.backend_for(backend)
        """How this process gets out of a dead generation's groups and lets them go (gloo, NCCL)."""
        for name, value in self.group_backend.environment().items():  # before any process group exists
            os.environ.setdefault(name, value)
        self.timeout_s = timeout_s
        self.ctl = open_store(timeout_s)
        """Control-plane client of the root store: what is rare or read across nodes. Never closed by a
        watchdog."""
        self.nodes = nodes
        apart = nodes is not None and nodes.node != 0
        self.open_local: StoreFactory = nodes.open_node if apart else open_store
        """Opens clients of the store where this process votes, beats and waits for generations: its node's."""
        self.local = self.open_local(timeout_s) if apart else self.ctl
        """Client of that store: votes, decisions, generations (the same object as ``ctl`` where it is the root)."""
        self.heartbeat = Heartbeat(self.open_local, launch_rank, heartbeat_s)
        self._topologies: dict[int, JobTopology] = {}
        start = self.topology(0)
        self.identity = start.slot_of(launch_rank)
        """(replica index, slot): what this process is, in every generation."""
        self.identities = {lr: start.slot_of(lr) for lr in range(start.world_size)}
        """Every launch rank's identity."""
        self.left_sockets: set[str] = set()
        """Identities of the sockets of every generation this process left (none may stay open)."""
        self.aware_upto = -1
        """Every generation up to this one is noted over (:meth:`note_aware`)."""
        self.held: list[_Held] = []
        """Process groups of ended generations, kept until no thread is busy in them (:class:`_Held`)."""
        self.current: Optional[Generation] = None
        """The generation joined and not left yet."""
        self.carried: dict[GroupKey, PooledGroup] = {}
        """Groups of the generation left that the next one shares (detached from torch, offered when it forms)."""

    def topology(self, generation: int) -> JobTopology:
        """Generation ``generation``'s topology. On several nodes computed from what its publication says changed,
        from the topology it builds on when this process has that one (as the controller computed it: reading the
        whole topology costs the root its size for every rank); read from the root otherwise."""
        if generation in self._topologies:
            return self._topologies[generation]
        topology = None
        if self.nodes is not None and generation > 0:
            info = self.info(generation)
            base = self._topologies.get(info["base"])
            if base is not None:
                topology = publication.computed(base, info, generation, self.nodes.min_tp, self.nodes.policy)
        if topology is None:
            topology = publication.topology(self.ctl, generation)
        self._topologies[generation] = topology
        for old in sorted(self._topologies)[:-TOPOLOGIES_KEPT]:
            del self._topologies[old]
        return topology

    def store_connections(self) -> dict[str, int]:
        """This process's connections to the root store and, on a node other than node 0, to its node's store (a
        resource report; none if the root's port is not known)."""
        if self.root_port is None:
            return {}
        out = {"root_connections": connections_to(self.root_port)}
        if self.local is not self.ctl:
            out["node_connections"] = connections_to(self.nodes.port)
        return out

    def latest(self) -> int:
        return publication.latest(self.local)

    def info(self, generation: int) -> dict:
        return publication.info(self.local, generation)

    def rank_in(self, topology: JobTopology) -> Optional[int]:
        return topology.rank_of(*self.identity)

    def join(self, topology: JobTopology) -> Generation:
        """Join ``topology``'s generation: default process group, then (by the caller) the NTP groups, which
        must be built inside :meth:`scope` so the watchdog knows their sockets."""
        rank = self.rank_in(topology)
        if rank is None:
            raise RuntimeError(f"launch rank {self.launch_rank} {self.identity} has no slot in generation "
                               f"{topology.generation}")
        # The watchdog first, on the generation's own store client: the rendezvous below waits for every member,
        # and a member that dies meanwhile must not cost the whole timeout.
        with SocketScope() as scope:
            store = self.open_store(self.timeout_s)
        watchdog = GenerationWatchdog(self.open_local, topology.generation, scope.sockets, timing.current().watch_timeout_s,
                                      self.group_backend, replica=self.identity[0])
        if self.backend == "gloo":  # the escape works around gloo's own behaviour (NCCL: not run here)
            torch_distributed_work.set_escape(watchdog)
        if self.nodes is None:
            commit = CommitProtocol(self.ctl, topology.generation, topology.world_size)
        else:
            commit = CommitProtocol(self.local, topology.generation, topology.world_size,
                                    node=self.nodes.share(topology, self.identities), root=self.ctl)
        generation = Generation(topology=topology, rank=rank, commit=commit, watchdog=watchdog, store=store,
                                pool=GroupPool(topology.generation, store_sockets=dict(scope.sockets)))
        try:
            _reset_group_names()
            with self.scope(generation):
                dist.init_process_group(backend=self.backend, rank=rank, world_size=topology.world_size,
                                        store=dist.PrefixStore(keys.process_group_prefix(topology.generation), store),
                                        timeout=timedelta(seconds=self.timeout_s))
            watchdog.default_group = distributed_c10d.GroupMember.WORLD  # this generation's, whenever it fires
        except BaseException:
            # The groups carried from the generation before were not offered yet: they stay carried, for the members'
            # verdict in the next generation (a rendezvous cut short by a death is common in a burst).
            self.leave(generation, keep=list(self.carried))
            raise
        self.current = generation
        return generation

    def scope(self, generation: Generation) -> "_Extend":
        """``with elastic.scope(gen): build groups`` — the sockets opened inside belong to ``gen`` too."""
        return _Extend(generation)

    def leave(self, generation: Generation, ended: bool = True, keep: Iterable[GroupKey] = ()) -> None:
        """Drop everything of ``generation``: its groups (torch.distributed's and Megatron's), its client, its
        watchdog, but for the groups in ``keep`` (those the next generation shares), which are taken out of
        torch's tables and carried to it (:meth:`offer`). ``ended``: the generation was marked over (the watchdog
        thread finishes now); at the normal end of the job nobody marks it, and the watchdog, a daemon thread,
        simply ends with the process."""
        torch_distributed_work.set_escape(None)
        if ended:
            generation.watchdog.join(timeout=timing.current().watchdog_join_s)
        keep = set(keep) - generation.watchdog.cut if ended else set()  # a group cut cannot go on
        pool = generation.pool
        # Groups carried here and not made or kept yet (a formation cut short) are detached already.
        detached = {**self.carried, **pool.offered}
        carried = {**pool.detach(keep), **{k: pooled for k, pooled in detached.items() if k in keep}}
        released = [pooled for key, pooled in pool.groups.items() if key not in carried]
        dropped = [pooled for key, pooled in detached.items() if key not in carried]
        self.carried, pool.offered = {}, {}
        if dropped:
            self._let_go(dropped)
        if ended:
            self.group_backend.let_go(released)  # not cut yet where no member died: their probes must fail at once
            if self.backend == "gloo":
                self.held.append(_hold(list(distributed_c10d._world.pg_map), generation.watchdog.abandoned_waits))
        # Unconditionally: Megatron's initializer, cut short by a failure, leaves some of its groups set while
        # model_parallel_is_initialized() says no, and the next generation's initializer would refuse to run.
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - sockets already shut down: nothing left to tell peers
                logger.warning("destroy_process_group after the generation ended: %s", exc)
        generation.store = None
        self.left_sockets.update(generation.watchdog.sockets.values())
        for pooled in released:
            self.left_sockets.update(pooled.sockets.values())
        self.carried = carried
        self.current = None
        self.release_held()

    def offer(self, generation: Generation, wanted: Iterable[GroupKey]) -> None:
        """As ``generation`` forms, before its groups are made: say which of the groups this rank wants in it it
        holds (the incarnation and the collectives issued on each), read what every other member of the groups
        it holds says, and offer to the group maker those every member holds alike
        (:func:`ntp_megatron.plan.group_plan.keep_verdict`); the others are let go of. Every member of every wanted
        group writes once, so nobody waits on a member that holds nothing. Bounded by the store's timeout, and
        cut short with the generation (its store client is shut down)."""
        wanted = list(wanted)
        carried = self.carried  # cleared only once resolved: a failure in here leaves them to leave()
        mine = {k: Offer(carried[k].made_in, carried[k].issued()) if k in carried else Offer(None, 0) for k in wanted}
        identity = self.identity
        keys.offer_groups(generation.store, generation.number, identity,
                          {k.label(): o.to_json() for k, o in mine.items()})
        said: dict[tuple[int, ...], dict[str, list]] = {identity: {k.label(): o.to_json() for k, o in mine.items()}}
        offered: dict[GroupKey, PooledGroup] = {}
        for k in wanted:
            if k not in carried:
                continue
            for member in k.members:
                if member not in said:
                    said[member] = keys.offered_groups(generation.store, generation.number, member)
            offers = {m: Offer.from_json(said[m][k.label()]) if k.label() in said[m] else Offer(None, 0)
                      for m in k.members}
            if keep_verdict(offers):
                offered[k] = carried[k]
            else:
                logger.info("generation %d: group %s is made anew (its members hold %s)", generation.number,
                            k.label(), {"/".join(map(str, m)): o.to_json() for m, o in offers.items()})
        let_go = [pooled for k, pooled in carried.items() if k not in offered]
        generation.pool.offered, self.carried = offered, {}
        if let_go:
            self._let_go(let_go)

    def _let_go(self, groups: list[PooledGroup]) -> None:
        """Groups out of torch's tables that do not go on: shut down (a collective stranded in one fails at once),
        held until idle (:class:`_Held`)."""
        hold = self.group_backend.let_go(groups)
        for pooled in groups:
            self.left_sockets.update(pooled.sockets.values())
        if hold:
            self.held.append(_hold(hold, []))

    def drain_kept(self, generation: Generation) -> None:
        """Before a kept group is used in ``generation``: a barrier in each, so that a collective some member had
        walked away from in the generation before (every member issued it: the verdict) has finished, and writes
        nothing into memory the new generation uses. Every member drains the same groups."""
        works = [generation.pool.groups[k].group.barrier() for k in generation.pool.kept]
        for work in works:
            work.wait()

    def pinned_sockets(self) -> set[str]:
        """Sockets this process's live groups hold open (their pairs, and the store client of the generation that
        made each): those of a group that went on into later generations belong to a generation left, rightly."""
        live = list(self.carried.values()) + (list(self.current.pool.groups.values()) if self.current else [])
        return {ident for pooled in live for ident in (*pooled.sockets.values(), *pooled.pins.values())}

    def release_held(self) -> int:
        """Drop the groups of ended generations once no thread is busy in them; returns how many generations'
        groups are still held."""
        self.held = [held for held in self.held if not held.idle()]
        return len(self.held)

    def park_held(self) -> None:
        """At the end of the process: groups still held are never destroyed (their destructor would wait for gloo's
        blocked thread, holding the GIL); the process ends with ``os._exit`` and takes them along."""
        _PARKED.extend(self.held)
        self.held = []

    def stale_sockets(self) -> int:
        """Sockets of generations this process left that are still open (a leak if not 0, unless a generation's
        groups are held, see :meth:`release_held`)."""
        pinned = self.pinned_sockets()
        return sum(1 for ident in socket_fds().values() if ident in self.left_sockets and ident not in pinned)

    def end_generation(self, generation: Generation) -> None:
        """Mark ``generation`` over ourselves (a planned move: everyone is done with it), so its watchdogs end; on
        another node than node 0, one rank of the node also marks it in the root, where the node relays follow the
        generations."""
        keys.end(self.local, generation.number, keys.MOVED)
        if self.local is not self.ctl and self.nodes.first_on_node(generation.topology, self.identities,
                                                                   self.launch_rank):
            keys.end(self.ctl, generation.number, keys.MOVED)

    def announce(self) -> None:
        """A replacement process is up and ready to be admitted."""
        keys.announce_joining(self.ctl, self.launch_rank)

    def note_aware(self, generation: int) -> None:
        """Record when this rank learnt that ``generation`` is over (for the controller's detection latency),
        and every earlier one not noted yet: a generation whose formation this rank never finished or never
        reached (it started late, a failure interrupted the rendezvous) ends for it when it learns of a newer one."""
        now = time.time()
        for g in range(self.aware_upto + 1, generation + 1):
            note_aware(self.ctl, g, self.launch_rank, now)
        self.aware_upto = max(self.aware_upto, generation)

    def await_newer(self, generation: int) -> tuple[JobTopology, dict]:
        """Wait (bounded) until a generation newer than ``generation`` is published or the job is stopped;
        returns the newest topology and why it exists."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if keys.is_stopped(self.local):
                raise JobStopped(f"job stopped by the launcher: {keys.stop_reason(self.local)}")
            latest = max(publication.newest(self.local), 0)
            if latest > generation:
                return self.topology(latest), self.info(latest)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no generation after {generation} within {self.timeout_s:.0f} s")
            time.sleep(timing.current().generation_poll_s)

    def marked_over(self, generation: int, within_s: float) -> bool:
        """Whether ``generation`` is marked over or the job stopped, now or within ``within_s`` seconds (a
        bounded poll of the store; see :mod:`ntp_megatron.elastic.errors`)."""
        deadline = time.monotonic() + within_s
        while not keys.is_ended(self.local, generation) and not keys.is_stopped(self.local):
            if time.monotonic() > deadline:
                return False
            time.sleep(timing.current().generation_poll_s)
        return True


def _reset_group_names() -> None:
    """torch names an unnamed group after a counter (the default group's store prefix is ``<count>/``), bumps it
    even when ``init_process_group`` fails half-way, and resets it only in ``destroy_process_group``. A rank whose
    last rendezvous was interrupted by a failure would name its next default group ``1`` while its peers name
    theirs ``0``, and the two rendezvous would never meet. With no default group, the count starts over."""
    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


_PARKED: list["_Held"] = []
"""Held groups of a process that is ending (:meth:`ElasticRank.park_held`)."""


@dataclass
class _Held:
    """The process groups of an ended generation, kept until no thread is busy in them. A gloo group's destructor
    joins its worker threads, holding the GIL: one still blocked in a collective that gloo never wakes (see
    :mod:`ntp_megatron.patches.torch_distributed_work`) would freeze the whole rank, heartbeat included, until the
    collective timeout. Whether a worker is still busy is asked of gloo itself: a barrier starts only after every
    collective queued before it has ended (and, the sockets being down, then fails at once)."""

    groups: list[dist.ProcessGroup]
    probes: list[dist.Work]
    waits: list[AbandonedWait]
    """Point-to-point waits given up: their helper threads still use the group's gloo context."""

    def idle(self) -> bool:
        return all(probe.is_completed() for probe in self.probes) and all(wait.finished() for wait in self.waits)


def _hold(groups: list[dist.ProcessGroup], waits: list[AbandonedWait]) -> _Held:
    probes = []
    for group in groups:
        try:
            probes.append(group.barrier())
        except Exception:  # noqa: BLE001 - refused at once: nothing of the group runs
            pass
    return _Held(groups, probes, list(waits))


class _Extend:
    """Adds the sockets opened inside the block to a generation's watchdog."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    def __enter__(self) -> None:
        self._scope = SocketScope().__enter__()
        self._before = set(self.generation.pool.groups)

    def __exit__(self, *exc) -> None:
        self._scope.__exit__(*exc)
        pool = self.generation.pool
        new = [pooled for key, pooled in pool.groups.items() if key not in self._before]
        of_groups = {fd for pooled in new for fd in pooled.sockets}
        self.generation.watchdog.add({fd: i for fd, i in self._scope.sockets.items() if fd not in of_groups})
        self.generation.watchdog.add_groups(new)
