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

*Two levels* (:class:`NodeShare`, :mod:`ntp_megatron.elastic.relay`): the ranks count in their node's store and
the node relay carries one count per node to the root; the node whose count completes the root's decides there,
with the same first-writer-wins rule against the controller, and every relay writes the decision back into its
node's store, where the ranks wait for it. The iteration's keys are deleted two iterations later, when nobody can
read them again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ntp_megatron.elastic import keys
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
    count in the node's store), ``nodes`` nodes with a rank of it (their relays count in the root)."""
    members: int
    nodes: int


class CommitProtocol:
    """Votes of one rank in one generation. ``store`` is a client that survives the generation (not the
    generation's own client, whose sockets the watchdog shuts down): the root store, or with ``node`` set the
    node's store, whose relay carries the node's count to the root."""

    def __init__(self, store: dist.Store, generation: int, world_size: int, node: Optional[NodeShare] = None) -> None:
        self.store, self.generation, self.world_size, self.node = store, generation, world_size, node

    def vote(self, iteration: int) -> str:
        """Vote to commit 1-based ``iteration`` and wait for the decision: ``commit`` or ``abort``."""
        key = keys.decision(self.generation, iteration)
        self._count(keys.votes(self.generation, iteration), key, {"vote": [self.generation, iteration]},
                    lambda: decide_iteration(self.store, self.generation, iteration))
        return self._await(key, ABORT)

    def _count(self, counter: str, key: str, tally: dict, decide) -> None:
        """Count this rank in ``counter``; the rank that completes it decides (one level), or asks the node relay
        to carry the node's count to the root (two levels; the first rank of the node asks it to bring the
        decision on ``key`` back whatever becomes of the count, so a node whose other ranks died still hears)."""
        n = self.store.add(counter, 1)
        if self.node is None:
            if n == self.world_size:
                decide()
            return
        if n == 1:
            self.store.queue_push(keys.RELAY_QUEUE, json.dumps({"await": key, "generation": self.generation}))
        if n == self.node.members:
            self.store.queue_push(keys.RELAY_QUEUE, json.dumps({**tally, "nodes": self.node.nodes}))

    def decision(self, iteration: int) -> str | None:
        """The decision on ``iteration`` in this generation, if one was made."""
        key = keys.decision(self.generation, iteration)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def form(self) -> str:
        """Report that this rank finished re-forming into this generation; wait for ``complete`` or
        ``incomplete``."""
        key = keys.formed(self.generation)
        self._count(keys.ready(self.generation), key, {"form": self.generation},
                    lambda: decide_formation(self.store, self.generation))
        return self._await(key, INCOMPLETE)

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
