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

This module owns the commit protocol's keys in the control-plane store (node 0's root store; with two levels the
node stores hold the keys the node's ranks count and wait on, and copies of the root's decisions), their writers and
their readers: nothing else names them or touches them.

- ``elastic/start``: the iteration the run starts from. Written by the controller as the run starts
  (:func:`init_progress`); read by a fresh process (:func:`start_iteration`).
- ``elastic/committed``: the newest committed iteration (1-based). Written by :func:`init_progress`, the winner of an
  iteration's race (:func:`decide_iteration`) and the controller's :func:`settle`; read by the controller, a fresh
  process, the launcher (:func:`committed`), a node's relay (:func:`decided_in_root`).
- ``elastic/consumed``: samples consumed by the newest committed iteration. Written by :func:`init_progress` and
  generation rank 0 after each step (:func:`record_consumed`); read by a fresh process (:func:`consumed`).
- ``elastic/completed``: the newest generation whose formation completed. Written by the winner of a formation's race
  (:func:`decide_formation`) and the controller (:func:`record_completed`); read by the controller
  (:func:`completed`) and the launcher (:func:`newest_completed`).
- ``elastic/gen<g>/iter<k>/votes``: counter of the ranks that voted on iteration k (one level); each voter reads
  the count its own ``add`` answers.
- ``elastic/gen<g>/node_tally``: in a node's store, counter of its ranks' votes on every iteration of g.
- ``elastic/gen<g>/iter<k>/node_votes``: in the root, counter of the nodes whose every rank voted on k.
- ``elastic/gen<g>/iter<k>/decision``: ``commit``, ``commit+reform`` or ``abort``, first writer wins: the last
  voter or the controller (:func:`settle`); a node's last voter copies it into the node's store (:meth:`CommitProtocol
  .bring`). Read by every rank, the controller (:func:`decided`) and a node's relay (:func:`decided_in_root`).
- ``elastic/gen<g>/iter<k>/started``: counter of the ranks (of the root's node) that began k; read by :func:`settle`.
- ``elastic/gen<g>/ready`` and ``elastic/gen<g>/node_ready``: counters of the ranks (nodes) that finished re-forming.
- ``elastic/gen<g>/formed``: ``complete`` (the last ready rank) or ``incomplete`` (the controller,
  :func:`abandon_formation`), first writer wins; read as the decisions are.
- ``elastic/gen<g>/aware/<launch rank>`` and ``elastic/gen<g>/aware_count``: when a survivor learnt that g is over,
  and how many did (:func:`note_aware`); read by the controller's failure report (:func:`aware_count`,
  :func:`noted_aware`, :func:`aware_times`).

Why these together: ``committed`` and ``completed`` are written by the winners of the two first-writer-wins races and
by the controller's settle, and ``start`` and ``consumed`` are written with ``committed`` when the run starts: the
run's progress is the protocol's outcome. ``aware`` is noted as a rank leaves a generation the protocol ended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ntp_megatron.config import timing
from ntp_megatron.elastic import keys, publication
from ntp_megatron.elastic.keys import PREFIX
from ntp_megatron.phases import waiting

COMMIT, ABORT = "commit", "abort"
COMMIT_REFORM = "commit+reform"
"""Commit, then move everyone to the next (already published) generation at this iteration boundary."""
COMMITTED_DECISIONS = (COMMIT, COMMIT_REFORM)
COMPLETE, INCOMPLETE = "complete", "incomplete"

# -- the keys ---------------------------------------------------------------------------------------------------------
START = PREFIX + "start"
"""The iteration the run starts from: 0, or the iteration of the checkpoint it loads (``checkpoint.load``).
Until an iteration after it commits, no process holds anything it could not rebuild itself: every rank of a
forming generation builds its state from the seed or from that checkpoint, and nothing moves between ranks."""
COMMITTED = PREFIX + "committed"
"""The newest committed iteration (1-based), written by the rank whose vote completed it."""
CONSUMED = PREFIX + "consumed"
"""Samples consumed by the newest committed iteration (written by generation rank 0 after each step)."""
COMPLETED = PREFIX + "completed"
"""The newest generation whose re-formation completed (every rank holds its layout)."""


def votes_key(generation: int, iteration: int) -> str:
    """Counter of the ranks that voted on iteration ``k`` of generation ``g`` (one level)."""
    return f"{PREFIX}gen{generation}/iter{iteration}/votes"


def decision_key(generation: int, iteration: int) -> str:
    """``commit`` (written by the last voter) or ``abort`` (by the controller): the first writer wins."""
    return f"{PREFIX}gen{generation}/iter{iteration}/decision"


def node_votes_key(generation: int, iteration: int) -> str:
    """Two-level control plane: counter in the root of nodes whose every rank voted on iteration ``k`` of generation
    ``g`` (:mod:`ntp_megatron.elastic.relay`; its ranks count in the node's store in :func:`node_tally_key`)."""
    return f"{PREFIX}gen{generation}/iter{iteration}/node_votes"


def node_tally_key(generation: int) -> str:
    """Two-level control plane: the votes of a node's ranks in generation ``g``, all its iterations together, in the
    node's store (so no key per iteration is left to delete there)."""
    return f"{PREFIX}gen{generation}/node_tally"


def node_ready_key(generation: int) -> str:
    """Two-level control plane: counter of nodes whose every rank finished re-forming into generation ``g``."""
    return f"{PREFIX}gen{generation}/node_ready"


def started_key(generation: int, iteration: int) -> str:
    """Ranks that began iteration ``k`` in generation ``g`` (whether an aborted iteration cost any work)."""
    return f"{PREFIX}gen{generation}/iter{iteration}/started"


def iteration_keys(generation: int, iteration: int) -> list[str]:
    """The per-iteration keys of the commit protocol (deleted once nobody can read them again)."""
    return [votes_key(generation, iteration), node_votes_key(generation, iteration),
            decision_key(generation, iteration), started_key(generation, iteration)]


def ready_key(generation: int) -> str:
    """Counter of ranks that finished re-forming into generation ``g``."""
    return f"{PREFIX}gen{generation}/ready"


def formed_key(generation: int) -> str:
    """``complete`` (written by the last ready rank) or ``incomplete`` (by the controller): first writer wins."""
    return f"{PREFIX}gen{generation}/formed"


def aware_key(generation: int, launch_rank: int) -> str:
    """When a survivor noticed that generation ``g`` was over (wall-clock seconds)."""
    return f"{PREFIX}gen{generation}/aware/{launch_rank}"


def aware_count_key(generation: int) -> str:
    """How many ranks noted ``aware`` for generation ``g``: the controller polls this one key, not one per rank."""
    return f"{PREFIX}gen{generation}/aware_count"


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
            self.store.add(started_key(self.generation, iteration), 1)

    def vote(self, iteration: int) -> str:
        """Vote to commit 1-based ``iteration`` and wait for the decision: ``commit`` or ``abort``."""
        key = decision_key(self.generation, iteration)
        if self.node is None:
            if self.store.add(votes_key(self.generation, iteration), 1) == self.world_size:
                decide_iteration(self.store, self.generation, iteration)
        # Every iteration's votes of the generation count in one key of the node's store: the node's ranks all vote
        # on k before any of them votes on k + 1.
        elif self.store.add(node_tally_key(self.generation), 1) % self.node.members == 0:
            self.carry_vote(iteration)
            self.bring(key, iteration)
        return self._await(key, ABORT)

    def form(self) -> str:
        """Report that this rank finished re-forming into this generation; wait for ``complete`` or
        ``incomplete``."""
        key = formed_key(self.generation)
        n = self.store.add(ready_key(self.generation), 1)
        if self.node is None:
            if n == self.world_size:
                decide_formation(self.store, self.generation)
        elif n == self.node.members:
            self.carry_ready()
            self.bring(key)
        return self._await(key, INCOMPLETE)

    def carry_vote(self, iteration: int) -> None:
        """The node's last voter: count the node in the root, and decide if that completes the root's count."""
        if self.root.add(node_votes_key(self.generation, iteration), 1) == self.node.nodes:
            decide_iteration(self.root, self.generation, iteration)

    def carry_ready(self) -> None:
        """The node's last rank to finish re-forming: as :meth:`carry_vote`."""
        if self.root.add(node_ready_key(self.generation), 1) == self.node.nodes:
            decide_formation(self.root, self.generation)

    def decision(self, iteration: int) -> str | None:
        """The decision on ``iteration`` in this generation, if one was made."""
        key = decision_key(self.generation, iteration)
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
            self.store.delete_key(decision_key(self.generation, iteration - 2))

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
            if keys.is_ended(self.root, self.generation) and not self.root.check([key]):
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
            over = keys.is_ended(self.store, self.generation)  # first: any decision is written before it
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
    value = COMMIT_REFORM if publication.boundary_requested(store, generation) else COMMIT
    decided = _first_write(store, decision_key(generation, iteration), value)
    if decided == value:
        store.set(COMMITTED, str(iteration))
        if iteration > 2:
            for key in iteration_keys(generation, iteration - 2):
                store.delete_key(key)
    return decided


def decide_formation(store: dist.Store, generation: int) -> str:
    """Every rank (or node) finished re-forming into ``generation``: ``complete``, unless the controller's
    ``incomplete`` came first. Returns the verdict."""
    decided = _first_write(store, formed_key(generation), COMPLETE)
    if decided == COMPLETE:
        store.set(COMPLETED, str(generation))
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
    committed = int(store.get(COMMITTED).decode()) if store.check([COMMITTED]) else 0
    last = decision_key(generation, committed)
    decided = store.get(last).decode() if committed and store.check([last]) else None
    iteration = committed + 1
    while decided != COMMIT_REFORM:
        decided = _first_write(store, decision_key(generation, iteration), ABORT)
        if decided not in COMMITTED_DECISIONS:
            break
        iteration += 1
    if iteration - 1 > committed:
        store.set(COMMITTED, str(iteration - 1))
    if decided == COMMIT_REFORM:
        return None
    return iteration, ABORT, int(store.add(started_key(generation, iteration), 0))


def abandon_formation(store: dist.Store, generation: int) -> bool:
    """Controller side: mark a re-formation incomplete unless it already completed; True if it was stopped."""
    return _first_write(store, formed_key(generation), INCOMPLETE) == INCOMPLETE


def note_aware(store: dist.Store, generation: int, launch_rank: int, when: float) -> None:
    """Record when ``launch_rank`` learnt that ``generation`` is over, and count it."""
    store.set(aware_key(generation, launch_rank), repr(when))
    store.add(aware_count_key(generation), 1)


# -- the run's progress -----------------------------------------------------------------------------------------------

def init_progress(store: dist.Store, start_iteration: int, start_consumed: int) -> int:
    """Controller side, as the job starts: record where the run starts from unless a previous launch of the same store
    did (``committed`` is set); returns the iteration the run started from."""
    if not store.check([COMMITTED]):
        store.set(START, str(start_iteration))
        store.set(COMMITTED, str(start_iteration))
        store.set(CONSUMED, str(start_consumed))
    return int(store.get(START).decode())


def start_iteration(store: dist.Store) -> int:
    """The iteration the run started from (0, or the loaded checkpoint's), as the controller recorded it."""
    return int(store.get(START).decode())


def committed(store: dist.Store) -> int:
    """The newest committed iteration (waits, within the store's timeout, until the controller recorded the start)."""
    return int(store.get(COMMITTED).decode())


def consumed(store: dist.Store) -> int:
    """Samples consumed by the newest committed iteration."""
    return int(store.get(CONSUMED).decode())


def record_consumed(store: dist.Store, consumed_samples: int) -> None:
    """Generation rank 0, after each step: the samples consumed by the iteration it committed."""
    store.set(CONSUMED, str(consumed_samples))


def completed(store: dist.Store) -> int:
    """The newest generation whose formation completed; -1 while generation 0 is still forming."""
    return int(store.get(COMPLETED).decode()) if store.check([COMPLETED]) else -1


def newest_completed(store: dist.Store) -> int:
    """:func:`completed` in one request (no wait)."""
    value = keys.read_if_set(store, COMPLETED)
    return int(value.decode()) if value is not None else -1


def record_completed(store: dist.Store, generation: int) -> None:
    """Controller side: ``generation``'s formation completed (its last rank won the race, and had not recorded it)."""
    store.set(COMPLETED, str(generation))


def decided(store: dist.Store, generation: int) -> list[tuple[str, str]]:
    """Controller side: what ``generation`` decided that a rank may still wait for as it ends (its formation's verdict,
    the last committed iteration's decision, the next one's), as keys and values for the nodes' relays to copy."""
    last = committed(store)
    out = []
    for key in (formed_key(generation), decision_key(generation, last), decision_key(generation, last + 1)):
        if store.check([key]):
            out.append((key, store.get(key).decode()))
    return out


def is_decided(store: dist.Store, generation: int, iteration: int) -> bool:
    """Whether ``iteration`` of ``generation`` is decided."""
    return store.check([decision_key(generation, iteration)])


def committed_in_root(root: dist.Store) -> int:
    """A node's relay: the newest committed iteration, in one request."""
    return int(keys.read_if_set(root, COMMITTED).decode())


def decided_in_root(root: dist.Store, generation: int, last: int) -> list[tuple[str, bytes]]:
    """A node's relay: :func:`decided` with ``last`` the committed iteration, one request per key, those written."""
    out = []
    for key in (formed_key(generation), decision_key(generation, last), decision_key(generation, last + 1)):
        value = keys.read_if_set(root, key)
        if value is not None:  # the same value where a rank of the node brought it already
            out.append((key, value))
    return out


# -- when the survivors learnt that a generation is over --------------------------------------------------------------

def aware_count(store: dist.Store, generation: int) -> int:
    """How many ranks noted that ``generation`` is over (:func:`note_aware`), in one request."""
    return int(store.add(aware_count_key(generation), 0))


def noted_aware(store: dist.Store, generation: int, launch_rank: int) -> bool:
    """Whether ``launch_rank`` noted that ``generation`` is over."""
    return store.check([aware_key(generation, launch_rank)])


def aware_times(store: dist.Store, generation: int, launch_ranks: list[int]) -> Optional[list[float]]:
    """When each of ``launch_ranks`` noted that ``generation`` is over, if every one did (one request each way)."""
    names = [aware_key(generation, lr) for lr in launch_ranks]
    if not store.check(names):
        return None
    return [float(raw.decode()) for raw in store.multi_get(names)] if names else []
