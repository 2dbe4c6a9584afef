"""Names of the store keys the controller, the ranks and the launchers share: in node 0's TCPStore (the root), and
on a job of several nodes under NTP those a node's ranks vote, beat and wait on in their node's store too, where they
are copies of the root's (:mod:`ntp_megatron.elastic.relay`).

A *generation* is one process-group epoch: its topology, its own store prefix for torch.distributed
(``gen<g>/``), and its own keys below. Generations only grow; the job starts at generation 0.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Optional, Sequence

PREFIX = "elastic/"
LATEST = PREFIX + "latest"
"""The newest published generation (an integer)."""
COMPLETED = PREFIX + "completed"
"""The newest generation whose re-formation completed (every rank holds its layout)."""
COMMITTED = PREFIX + "committed"
"""The newest committed iteration (1-based), written by the rank whose vote completed it."""
CONSUMED = PREFIX + "consumed"
"""Samples consumed by the newest committed iteration (written by generation rank 0 after each step)."""
START = PREFIX + "start"
"""The iteration the run starts from: 0, or the iteration of the checkpoint it loads (``checkpoint.load``).
Until an iteration after it commits, no process holds anything it could not rebuild itself: every rank of a
forming generation builds its state from the seed or from that checkpoint, and nothing moves between ranks."""
STOP = PREFIX + "stop"
"""Set by the controller when the job must end (a failure NTP cannot absorb); the value says why."""


def process_group_prefix(generation: int) -> str:
    """The store prefix under which generation ``generation``'s process groups rendezvous."""
    return f"gen{generation}/"


def topology(generation: int) -> str:
    """JSON: generation ``generation``'s topology, published by the controller."""
    return f"topology/gen{generation}"


def info(generation: int) -> str:
    """JSON: why generation ``g`` exists (the dead launch ranks since the last completed generation, ...)."""
    return f"{PREFIX}gen{generation}/info"


def abort(generation: int) -> str:
    """Set when generation ``g`` is over: every rank's watchdog then closes that generation's sockets. Its value
    names the dead (:func:`abort_value`), or is :data:`MOVED` or ``stop``."""
    return f"{PREFIX}gen{generation}/abort"


MOVED = "moved"
"""The abort value of a generation its ranks left together at an admission boundary (nobody died)."""


def dead_named(value: bytes) -> Optional[set[tuple[int, ...]]]:
    """The identities of the dead that an abort key's value names (:func:`abort_value`); None: treat every
    group as blocked (a stop, or a value that names none)."""
    text = value.decode()
    if text == MOVED:
        return set()
    try:
        return {tuple(identity) for identity in json.loads(text)["dead"]}
    except (ValueError, KeyError, TypeError):
        return None


def abort_value(dead: Iterable[Sequence[int]], copy: Sequence[tuple[str, str]] = ()) -> str:
    """What the controller writes to a generation's abort key when ranks died: their identities, and what a node
    store needs before the end (``copy``: keys and values, written in order by the node's relay,
    :mod:`ntp_megatron.elastic.relay`): one read of the root per node instead of one per key."""
    value: dict = {"dead": sorted(list(identity) for identity in dead)}
    if copy:
        value["copy"] = [list(pair) for pair in copy]
    return json.dumps(value)


def to_copy(value: bytes) -> Optional[list[tuple[str, str]]]:
    """The keys and values an abort key's value asks a node's relay to copy first (:func:`abort_value`); None if it
    says nothing (a move, a stop: the relay then reads the root)."""
    try:
        return [(key, text) for key, text in json.loads(value.decode())["copy"]]
    except (ValueError, KeyError, TypeError):
        return None


def group_offers(generation: int, identity: tuple[int, ...]) -> str:
    """What the process with ``identity`` offers of its groups as generation ``g`` forms
    (:func:`ntp_megatron.plan.group_plan.keep_verdict`)."""
    return f"{PREFIX}gen{generation}/group_offers/{'-'.join(map(str, identity))}"


def votes(generation: int, iteration: int) -> str:
    return f"{PREFIX}gen{generation}/iter{iteration}/votes"


def decision(generation: int, iteration: int) -> str:
    """``commit`` (written by the last voter) or ``abort`` (by the controller): the first writer wins."""
    return f"{PREFIX}gen{generation}/iter{iteration}/decision"


def node_votes(generation: int, iteration: int) -> str:
    """Two-level control plane: counter in the root of nodes whose every rank voted on iteration ``k`` of generation
    ``g`` (:mod:`ntp_megatron.elastic.relay`; its ranks count in the node's store in :func:`node_tally`)."""
    return f"{PREFIX}gen{generation}/iter{iteration}/node_votes"


def node_tally(generation: int) -> str:
    """Two-level control plane: the votes of a node's ranks in generation ``g``, all its iterations together, in the
    node's store (so no key per iteration is left to delete there)."""
    return f"{PREFIX}gen{generation}/node_tally"


def node_ready(generation: int) -> str:
    """Two-level control plane: counter of nodes whose every rank finished re-forming into generation ``g``."""
    return f"{PREFIX}gen{generation}/node_ready"


def node_beat(node_rank: int) -> str:
    """Two-level control plane: a node relay's heartbeat in the root store (JSON ``{"t", "ranks"}``), one per node
    instead of one per rank."""
    return f"{PREFIX}node_hb/{node_rank}"


def iteration_keys(generation: int, iteration: int) -> list[str]:
    """The per-iteration keys of the commit protocol (deleted once nobody can read them again)."""
    return [votes(generation, iteration), node_votes(generation, iteration), decision(generation, iteration),
            started(generation, iteration)]


def ready(generation: int) -> str:
    """Counter of ranks that finished re-forming into generation ``g``."""
    return f"{PREFIX}gen{generation}/ready"


def formed(generation: int) -> str:
    """``complete`` (written by the last ready rank) or ``incomplete`` (by the controller): first writer wins."""
    return f"{PREFIX}gen{generation}/formed"


def aware(generation: int, launch_rank: int) -> str:
    """When a survivor noticed that generation ``g`` was over (wall-clock seconds)."""
    return f"{PREFIX}gen{generation}/aware/{launch_rank}"


def aware_count(generation: int) -> str:
    """How many ranks noted ``aware`` for generation ``g``: the controller polls this one key, not one per rank."""
    return f"{PREFIX}gen{generation}/aware_count"


def heartbeat(launch_rank: int) -> str:
    """JSON written by a rank's heartbeat thread (:class:`ntp_megatron.elastic.watchdog.Heartbeat`): when
    (``t``), the iteration and phase, its progress count and since when it waits on a collective."""
    return f"{PREFIX}hb/{launch_rank}"


STALLED = PREFIX + "stalled"
"""JSON set by a launcher while one of its ranks has waited on a collective longer than half
``ntp.heartbeat_timeout_s`` (launch rank, since, ``t`` the time it was last confirmed): the launchers then fence
their ranks that make no progress while not waiting (:class:`ntp_megatron.elastic.agent.Agent`)."""


def failure(launch_rank: int) -> str:
    """JSON written by a rank just before an injected failure: spec, phase, iteration, time."""
    return f"{PREFIX}failure/{launch_rank}"


def fired(spec: str) -> str:
    return f"{PREFIX}fired/{spec}"


def rank_error(launch_rank: int) -> str:
    """JSON written by a rank whose own code failed — a failed write, out of memory, a bug; not a peer's death —
    just before it exits: ``{"error": "<type>: <message>", "iteration": k, "phase": ..., "time": t}``. The launcher
    names it and stops the job instead of re-forming around it."""
    return f"{PREFIX}error/{launch_rank}"


# -- between the launchers of a job's nodes (ntp_megatron.launch.nodes) ---------------------------------------------
LAUNCHER_PREFIX = "launcher/"
ABORT = LAUNCHER_PREFIX + "abort"
"""JSON ``{"reason", "death"}``: a node's launcher ended the job; every other node stops its ranks and names the
same failure."""


def node(node_rank: int) -> str:
    """Set (to its pid) by node ``node_rank``'s launcher once it has connected to node 0's store."""
    return f"{LAUNCHER_PREFIX}node{node_rank}"


DEATHS = PREFIX + "deaths"
"""How many rank deaths launchers have published (node 0's controller reads them in order under NTP; without NTP
every node reads them to name the same failure)."""


def death(n: int) -> str:
    """JSON of the ``n``-th death a launcher published (1-based)."""
    return f"{PREFIX}death/{n}"


def reform_requested(generation: int) -> str:
    """Set by the controller to admit repaired ranks: the rank whose vote completes the next iteration of
    generation ``g`` decides ``commit+reform``, and everyone moves to the published next generation after it."""
    return f"{PREFIX}gen{generation}/reform_requested"


REBALANCE_REQUESTS = PREFIX + "rebalance_requests"
"""How many rebalance requests nodes other than 0 have made (``add``): node 0's controller polls this one key."""


def rebalance_request(n: int) -> str:
    """JSON of the ``n``-th rebalance request (1-based): a node other than 0 found slow ranks among its own
    (:mod:`ntp_megatron.plan.rebalance`): the node, the generation its measurements ran in, the decisions."""
    return f"{PREFIX}rebalance/{n}"


def joining(launch_rank: int) -> str:
    """Set by a replacement process once it has started and is ready to be admitted (JSON: time, pid)."""
    return f"{PREFIX}joining/{launch_rank}"


def stopped_at_end(launch_rank: int) -> str:
    """Set by a node's launcher before it stops ``launch_rank``'s replacement at the end of the run (it was never
    part of a completed formation): its exit is no failure, on whichever node the controller sees it."""
    return f"{PREFIX}stopped_at_end/{launch_rank}"


def moved(generation: int) -> str:
    """Bytes received while forming generation ``g`` (summed over its ranks)."""
    return f"{PREFIX}gen{generation}/moved"


def lower_bound(generation: int) -> str:
    """Bytes forming generation ``g`` must move at least (summed over its ranks: each adds what it lacks itself)."""
    return f"{PREFIX}gen{generation}/lower_bound"


def shards_received(generation: int, rank: int) -> str:
    """The distributed-optimizer shards rank ``rank`` of generation ``g`` received while forming it: a JSON list of
    [block, position, bytes]."""
    return f"{PREFIX}gen{generation}/shards_received/{rank}"


def started(generation: int, iteration: int) -> str:
    """Ranks that began iteration ``k`` in generation ``g`` (whether an aborted iteration cost any work)."""
    return f"{PREFIX}gen{generation}/iter{iteration}/started"


def saved(iteration: int) -> str:
    """Set by every rank that returned from saving iteration ``k``'s checkpoint (so it is complete)."""
    return f"{PREFIX}saved/{iteration}"


def evaluated(generation: int, iteration: int, split: str, final: bool) -> str:
    """JSON record of an evaluation, written by every rank that completed it in generation ``g`` (so a rank whose
    evaluation failed there knows, after the re-formation, whether to do it again)."""
    return f"{PREFIX}gen{generation}/evaluated/{split}/{iteration}{'/final' if final else ''}"


_ABSENT = "\x00absent"
"""What ``compare_set`` answers for a key that does not exist (and then leaves it absent)."""


def read_if_set(store: Any, key: str) -> Optional[bytes]:
    """``key``'s value in ``store`` (a ``torch.distributed.Store``), or None if it is not set: one request
    (``check`` then ``get`` are three)."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else value
