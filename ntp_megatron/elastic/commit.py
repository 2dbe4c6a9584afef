"""Exactly-once optimizer steps: one first-writer-wins decision per iteration in the launcher's store.

Every cross-rank reduction of an iteration (gradient sync, token count, loss for the log, grad norm) happens
before the commit point; the optimizer step after it is local. At the commit point each rank adds its vote to
the iteration's counter; the rank whose vote completes the count writes ``commit`` with ``compare_set``, and
the controller, when a rank of the generation dies, writes ``abort`` the same way. Whoever is first decides,
for every rank alike: a rank steps only on ``commit``. After a failure, a survivor that had not yet stepped a
committed iteration rolls forward; an aborted iteration is redone by everyone from unchanged state. (A gloo
barrier is not enough: its outcome can differ between its members.)

The same two-writer rule decides whether a re-formation completed (:meth:`CommitProtocol.form`): the last
rank to finish writes ``complete``, the controller writes ``incomplete`` if a rank dies first.

*Two levels* (:class:`NodeShare`, :mod:`ntp_megatron.elastic.relay`): the ranks count in their node's store, and
the node's last voter adds one count for the node to the root; the node whose count completes the root's decides
there, with the same first-writer-wins rule against the controller, and each node's last voter brings the decision
into its node's store, where the node's ranks wait for it. The iteration's keys are deleted two iterations later,
when nobody can read them again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ntp_megatron.config import timing
from ntp_megatron.elastic import keys, publication
from ntp_megatron.phases import waiting

COMMIT, ABORT = "commit", "abort"
COMMIT_REFORM = "commit+reform"
"""Commit, then move everyone to the next (already published) generation at this iteration boundary."""
COMMITTED_DECISIONS = (COMMIT, COMMIT_REFORM)
COMPLETE, INCOMPLETE = "complete", "incomplete"


class IterationAborted(RuntimeError):
    """The controller aborted the iteration in flight: a rank of this generation failed."""


@dataclass(frozen=True)
class NodeShare:
    """Where a rank counts in the two-level control plane: ``members`` ranks of the generation on its node (they
    count in the node's store), ``nodes`` nodes with a rank of it (each node's last voter counts in the root)."""
    members: int
    nodes: int




class CommitProtocol:
    """Votes of one rank in one generation. ``store`` is a client that survives the generation (not the
    generation's own client, whose sockets the watchdog shuts down): the root store, or with ``node`` set the
    node's store; ``root`` is then a client of the root store (the same object as ``store`` on the node whose store
    is the root).

    With two levels the node's ranks count in the node's store; the last of them counts the node in the root, the
    node that completes the root's count decides there, and each node's last voter brings the root's decision
    into its node's store, where the node's other ranks wait for it. Where a node's last voter never brings it (it
    died, or the node's count never completed), the node's relay copies what the generation decided when the
    controller ends it (:mod:`ntp_megatron.elastic.relay`)."""

    def __init__(self, store: dist.Store, generation: int, world_size: int, node: Optional[NodeShare] = None,
                 root: Optional[dist.Store] = None) -> None:
        if (node is None) != (root is None):
            raise ValueError("two levels need both the node's share and a root client")
        self.store, self.generation, self.world_size, self.node = store, generation, world_size, node
        self.root = root if root is not None else store

    def begin(self, iteration: int) -> None:
        """This rank began ``iteration``: counted where the controller's :func:`settle` reads it, the root (with two
        levels only the ranks of the root's own node count there: the others' counts would cost the root a request
        per rank and iteration)."""
        if self.root is self.store:
            self.store.add(keys.started(self.generation, iteration), 1)

    def vote(self, iteration: int) -> str:
        """Vote to commit 1-based ``iteration`` and wait for the decision: ``commit`` or ``abort``."""
        key = keys.decision(self.generation, iteration)
        if self.node is None:
            if self.store.add(keys.votes(self.generation, iteration), 1) == self.world_size:
                decide_iteration(self.store, self.generation, iteration)
        # Every iteration's votes of the generation count in one key of the node's store: the node's ranks all vote
        # on k before any of them votes on k + 1.
        elif self.store.add(keys.node_tally(self.generation), 1) % self.node.members == 0:
            self.carry_vote(iteration)
            self.bring(key, iteration)
        return self._await(key, ABORT)

    def form(self) -> str:
        """Report that this rank finished re-forming into this generation; wait for ``complete`` or
        ``incomplete``."""
        key = keys.formed(self.generation)
        n = self.store.add(keys.ready(self.generation), 1)
        if self.node is None:
            if n == self.world_size:
                decide_formation(self.store, self.generation)
        elif n == self.node.members:
            self.carry_ready()
            self.bring(key)
        return self._await(key, INCOMPLETE)

    def carry_vote(self, iteration: int) -> None:
        """The node's last voter: count the node in the root, and decide if that completes the root's count."""
        if self.root.add(keys.node_votes(self.generation, iteration), 1) == self.node.nodes:
            decide_iteration(self.root, self.generation, iteration)

    def carry_ready(self) -> None:
        """The node's last rank to finish re-forming: as :meth:`carry_vote`."""
        if self.root.add(keys.node_ready(self.generation), 1) == self.node.nodes:
            decide_formation(self.root, self.generation)

    def decision(self, iteration: int) -> str | None:
        """The decision on ``iteration`` in this generation, if one was made."""
        key = keys.decision(self.generation, iteration)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def bring(self, key: str, iteration: Optional[int] = None) -> None:
        """The node's last voter: bring the root's decision on ``key`` into the node's store (for ``commit+reform``
        the generation it moves to first), and delete the node's copy of iteration - 2's, which its ranks all read
        before they voted on this one. Nothing to bring where the node's store is the root."""
        if self.root is self.store:
            return
        value = self.fetch(key)
        if value is None:  # the generation ended without a decision: the relay copies its end
            return
        if value == COMMIT_REFORM:  # the ranks move to the generation published for it: copy it first
            publication.copy_to_node(self.root, self.store, since=self.generation)
        self.store.set(key, value)
        if iteration is not None and iteration > 2:
            self.store.delete_key(keys.decision(self.generation, iteration - 2))

    def fetch(self, key: str) -> Optional[str]:
        """The root's value of ``key`` once written; None if the generation ended without one. Bounded by the root
        client's timeout, as :meth:`_await` is by the store's."""
        deadline = time.monotonic() + self.root.timeout.total_seconds()
        while True:
            try:
                with waiting():
                    self.root.wait([key], timedelta(seconds=timing.current().bring_wait_s))
                value = keys.read_if_set(self.root, key)  # None if the wait ended on a compare_set that wrote nothing
                if value is not None:
                    return value.decode()
            except dist.DistStoreError:
                pass  # not written within timing.bring_wait_s
            if self.root.check([keys.abort(self.generation)]) and not self.root.check([key]):
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no decision on {key} in the root store within its timeout")

    def _await(self, key: str, otherwise: str) -> str:
        """The value of a decision key. The controller writes its decision before it marks the generation
        over, so a generation marked over without a decision on ``key`` means nobody will write one: that
        counts as ``otherwise`` (the controller's verdict). A decision written as the wait timed out stands.
        Bounded by the store's timeout."""
        try:
            with waiting():  # on the other ranks' votes: the launcher must not take this rank for a stuck one
                self.store.wait([key])
        except dist.DistStoreError:
            over = self.store.check([keys.abort(self.generation)])  # first: any decision is written before it
            if not self.store.check([key]):
                if over:
                    return otherwise
                raise TimeoutError(f"no decision on {key} within the store timeout") from None
        return self.store.get(key).decode()


def decide_iteration(store: dist.Store, generation: int, iteration: int) -> str:
    """The last count of ``iteration`` is in (every rank's vote, or every node's): decide ``commit`` — or
    ``commit+reform`` where the controller asked for an admission boundary, one value read by everyone so every
    rank moves at the same iteration — unless the controller's ``abort`` came first. Returns the decision. The
    winner records the committed iteration and deletes the keys of the iteration two before (every rank has read
    its decision: each voted on the next one after it)."""
    value = COMMIT_REFORM if store.check([keys.reform_requested(generation)]) else COMMIT
    decided = _first_write(store, keys.decision(generation, iteration), value)
    if decided == value:
        store.set(keys.COMMITTED, str(iteration))
        if iteration > 2:
            for key in keys.iteration_keys(generation, iteration - 2):
                store.delete_key(key)
    return decided


def decide_formation(store: dist.Store, generation: int) -> str:
    """Every rank (or node) finished re-forming into ``generation``: ``complete``, unless the controller's
    ``incomplete`` came first. Returns the verdict."""
    decided = _first_write(store, keys.formed(generation), COMPLETE)
    if decided == COMPLETE:
        store.set(keys.COMPLETED, str(generation))
    return decided


def _first_write(store: dist.Store, key: str, value: str) -> str:
    """Write ``value`` unless someone wrote first; returns what the key holds now."""
    return store.compare_set(key, "", value).decode()


def settle(store: dist.Store, generation: int) -> Optional[tuple[int, str, int]]:
    """Controller side: decide the iteration in flight in ``generation`` — abort it, unless its commit won the
    race. Returns ``(iteration, "abort", ranks that had begun it)`` for the first iteration the controller could
    abort (every earlier one is committed), or None if the generation had already ended at an admission boundary
    (no iteration in flight). No rank can be past that iteration: a commit needs every rank's vote, and the dead
    cannot vote again.

    ``COMMITTED`` may lag the decisions by one iteration: the last voter writes it after its ``commit`` won, and
    may die in between. Settling brings it up to date, so that a later settle (the next generation's first
    failure) and a fresh process start after the right iteration."""
    committed = int(store.get(keys.COMMITTED).decode()) if store.check([keys.COMMITTED]) else 0
    last = keys.decision(generation, committed)
    decided = store.get(last).decode() if committed and store.check([last]) else None
    iteration = committed + 1
    while decided != COMMIT_REFORM:
        decided = _first_write(store, keys.decision(generation, iteration), ABORT)
        if decided not in COMMITTED_DECISIONS:
            break
        iteration += 1
    if iteration - 1 > committed:
        store.set(keys.COMMITTED, str(iteration - 1))
    if decided == COMMIT_REFORM:
        return None
    return iteration, ABORT, int(store.add(keys.started(generation, iteration), 0))


def abandon_formation(store: dist.Store, generation: int) -> bool:
    """Controller side: mark a re-formation incomplete unless it already completed; True if it was stopped."""
    return _first_write(store, keys.formed(generation), INCOMPLETE) == INCOMPLETE


def note_aware(store: dist.Store, generation: int, launch_rank: int, when: float) -> None:
    """Record when ``launch_rank`` learnt that ``generation`` is over, and count it."""
    store.set(keys.aware(generation, launch_rank), repr(when))
    store.add(keys.aware_count(generation), 1)
