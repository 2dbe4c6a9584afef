"""A job's control plane without rank processes: the real controller and the ranks' real protocol calls
(:class:`ntp_megatron.elastic.commit.CommitProtocol`) on one in-memory store, the ranks as threads where they
must wait for each other (a vote completes only when every rank voted)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from ntp_megatron.elastic import commit, publication
from ntp_megatron.elastic.commit import CommitProtocol, note_aware
from ntp_megatron.elastic.controller import Controller, Death
from ntp_megatron.plan.layout import Topology, make_topology
from ntp_megatron.plan.stages import JobTopology, make_pipeline_topology

UNITS = {"heads": 4, "ffn": 8, "vocab": 16}
WAIT_S = 10.0
"""Bound on every wait of a test thread (the store's own timeout is shorter)."""


def together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` at once, one thread each (as ranks would); their results, or the exceptions they raised."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive(), "a rank is still waiting for the others"
    return results


class Job:
    """Generation 0 of a ``tp`` x ``dp`` job on ``store`` (the controller's store may be a proxy of it)."""

    def __init__(self, store, tp: int, dp: int, start: int = 0, policy: str = "drop_replica", min_tp: int = 1,
                 controller_store=None, sharded=None, pp: int = 1) -> None:
        self.store = store
        self.said: list[str] = []
        self.events: list[dict] = []
        self.controller = Controller(controller_store if controller_store is not None else store,
                                     JobTopology.one_stage(make_topology(tp, dp, UNITS)) if pp == 1 else
                                     make_pipeline_topology(tp, dp, pp, UNITS), min_tp, policy, self.said.append,
                                     self.events.append, start_iteration=start, sharded=sharded)
        self.alive = set(range(tp * dp * pp))

    # -- what the store says -------------------------------------------------------------------------------------
    def topology(self, generation: int) -> JobTopology:
        return publication.topology(self.store, generation)

    def layout(self, generation: int) -> Topology:
        """The layout of a job without pipeline stages in ``generation``."""
        return self.topology(generation).only_stage

    def info(self, generation: int) -> dict:
        return publication.info(self.store, generation)

    def latest(self) -> int:
        return publication.latest(self.store)

    def committed(self) -> int:
        return int(self.store.get(commit.COMMITTED))

    def completed(self) -> int:
        return int(self.store.get(commit.COMPLETED)) if self.store.check([commit.COMPLETED]) else -1

    def protocol(self, generation: int, store=None) -> CommitProtocol:
        return CommitProtocol(store if store is not None else self.store, generation,
                              self.topology(generation).world_size)

    # -- what the ranks do ---------------------------------------------------------------------------------------
    def members(self, generation: int) -> list[int]:
        """Launch ranks with a slot in ``generation`` that are alive."""
        topology = self.topology(generation)
        return [lr for lr, slot in sorted(self.controller.identity.items())
                if topology.rank_of(*slot) is not None and lr in self.alive]

    def form(self, generation: int, ranks: Optional[list[int]] = None) -> list[str]:
        """``ranks`` (default: every live member) finish re-forming into ``generation``; their verdicts."""
        ranks = self.members(generation) if ranks is None else ranks
        return together([self.protocol(generation).form for _ in ranks])

    def commit(self, generation: int, iteration: int) -> list[str]:
        """Every live member of ``generation`` votes for ``iteration``; their decisions."""
        protocol = self.protocol(generation)
        return together([lambda: protocol.vote(iteration) for _ in self.members(generation)])

    def notice(self, generation: int) -> None:
        """Every live member notes that ``generation`` is over (the controller's failure report waits for it)."""
        for lr in self.alive:
            note_aware(self.store, generation, lr, time.time())

    def die(self, *launch_ranks: int) -> Optional[str]:
        """``launch_ranks`` die together and the controller handles them; what it returned (why the job stops)."""
        self.alive.difference_update(launch_ranks)
        self.notice(self.controller.latest.generation)
        self.notice(self.controller.completed.generation)
        reason = self.controller.handle([death(lr) for lr in launch_ranks])
        self.controller.close()
        return reason


def admission_pending(job: Job, replacement: int) -> None:
    """``replacement`` died at iteration 2 of generation 0; generation 1 formed without it and committed
    iteration 2; a new process for its slot is being admitted (generation 2 published, generation 1 asked to move
    after its next committed iteration)."""
    job.form(0)
    job.commit(0, 1)
    job.die(replacement)
    job.form(1)
    job.commit(1, 2)
    job.alive.add(replacement)
    assert job.controller.admit([replacement])


def death(launch_rank: int) -> Death:
    return Death(launch_rank, time.time(), "was killed by signal SIGKILL")


class InThread:
    """A rank in a protocol call that waits for the others (``vote(k)`` or ``form()``), in its own thread;
    returns once the rank's count (its vote, or its ready) is in, so whoever counts next comes after it."""

    def __init__(self, protocol: CommitProtocol, call: str, *args: Any) -> None:
        self.counted = threading.Event()
        self.result: Any = None
        store, counted = protocol.store, self.counted

        class _Signalling:
            def __getattr__(self, name):
                return getattr(store, name)

            def add(self, key, amount):
                value = store.add(key, amount)
                counted.set()
                return value

        mine = CommitProtocol(_Signalling(), protocol.generation, protocol.world_size)
        self._thread = threading.Thread(target=self._run, args=(getattr(mine, call), args), daemon=True)
        self._thread.start()
        assert self.counted.wait(WAIT_S), f"a rank's {call} did not get its count in"

    def _run(self, call: Callable[..., Any], args: tuple) -> None:
        try:
            self.result = call(*args)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            self.result = exc

    def outcome(self) -> Any:
        """What the call returned (or raised)."""
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "a rank is still waiting for a decision"
        return self.result


def voter(protocol: CommitProtocol, iteration: int) -> InThread:
    return InThread(protocol, "vote", iteration)


def former(protocol: CommitProtocol) -> InThread:
    return InThread(protocol, "form")
