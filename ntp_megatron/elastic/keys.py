"""The control-plane store's keys: their names, their writers and their readers, one owner per protocol.

The store is node 0's TCPStore (the root), hosted by its launcher; on a job of several nodes under NTP a node's ranks
vote, beat and wait on keys in their node's store too, where they are copies of the root's
(:mod:`ntp_megatron.elastic.relay`). A *generation* is one process-group epoch: its topology, its own store prefix
for torch.distributed (``gen<g>/``, :func:`process_group_prefix`), and its own keys. Generations only grow; the job
starts at generation 0.

Every key has one owner module, which holds its name, its writers and its readers; every other module calls the
owner's functions and never builds a key or calls the store itself (``tests/unit/elastic/test_store_keys.py`` checks
it). The owners, one per protocol:

- :mod:`ntp_megatron.elastic.commit`, the commit protocol and the run's progress: ``elastic/start``,
  ``elastic/committed``, ``elastic/consumed``, ``elastic/completed``, and per generation ``iter<k>/votes``,
  ``node_tally``, ``iter<k>/node_votes``, ``iter<k>/decision``, ``iter<k>/started``, ``ready``, ``node_ready``,
  ``formed``, ``aware/<r>``, ``aware_count``: two first-writer-wins races and the counters that lead to them, whose
  order of effects is the protocol.
- :mod:`ntp_megatron.elastic.publication`, what a generation is: ``topology/gen<g>``, ``elastic/gen<g>/info``,
  ``elastic/latest``, ``elastic/gen<g>/reform_requested``: written together by the controller, read by everyone.
- :mod:`ntp_megatron.launch.nodes`, between the launchers of a job's nodes: ``launcher/node<n>``,
  ``launcher/link``, ``launcher/lost/node<n>``, ``launcher/abort``, ``elastic/deaths``, ``elastic/death/<n>``,
  ``elastic/rebalance_requests``, ``elastic/rebalance/<n>``: only launchers write and read them.
- this module, every other key: one writer and one reader each, no race between writers (below).

This module's keys (``elastic/`` unless it says otherwise):

- ``stop``: why the job ends. Written by the controller (:func:`stop`); read by the ranks, the failure report, the
  worker nodes' launchers, a node's relay (:func:`is_stopped`, :func:`stop_reason`, :func:`stop_in_root`).
- ``gen<g>/abort``, *the end of g*: the dead's identities and what a node's relay copies first
  (:func:`abort_value`), or ``moved`` (:data:`MOVED`), or ``stop``. Written by the controller, by the ranks that
  leave g together at an admission boundary, by a node's relay into its node's store (:func:`end`); read by every
  rank's watchdog, the ranks, the relays, the control-plane load test (:func:`wait_end`, :func:`is_ended`,
  :func:`end_value`).
- ``hb/<launch rank>``: a rank's heartbeat (JSON: ``t``, iteration, phase, progress, collective sequence numbers per
  group, its wait). Written
  by the rank's heartbeat thread and the load test (:func:`beat`), placed by its launcher (:func:`place_beat`,
  :func:`reset_beat`); read by the launcher's agent (:func:`beats`).
- ``node_hb/<node rank>``: a node relay's heartbeat in the root (JSON ``{"t", "ranks"}``), one per node. Written by
  the relay (:func:`beat_node`); read by the load test (:func:`node_beats`).
- ``waits``: every launcher's ranks that have waited on their peers too long, with their collective sequence
  numbers (JSON, one entry per launcher). Written and read by the launchers' agents (:func:`publish_waits`,
  :func:`published_waits`); each launcher writes its own entry only (a ``compare_set`` loop).
- ``failure/<launch rank>`` and ``fired/<spec>``: an injected failure's record and that it fired. Written by the
  rank (:func:`record_failure`) and, across a restart, the launcher (:func:`mark_fired`); read by the failure
  report (:func:`injected_failure`, for the process that recorded it: a replacement's death is not reported with its
  predecessor's record), the rank and the launchers (:func:`has_fired`).
- ``armed/<launch rank>``: a random draw the launcher armed the rank with (JSON, :class:`ntp_megatron.faults.Draw`).
  Written by the launcher's agent in the root store (:func:`arm`); taken (read and deleted) by the rank at the start
  of an iteration (:func:`take_armed`); deleted when a replacement takes the launch rank over (:func:`disarm`).
- ``error/<launch rank>``: a rank's own error (JSON, with its pid: read for that process's death only). Written by the
  rank (:func:`record_error`); read by the controller (:func:`error_record`).
- ``joining/<launch rank>``: a replacement is up (JSON: time, pid). Written by it (:func:`announce_joining`); read
  and deleted by node 0's launcher (:func:`is_joining`, :func:`withdraw_joining`).
- ``stopped_at_end/<launch rank>``: a launcher stopped that replacement at the end of the run. Written and read by
  the launchers (:func:`mark_stopped_at_end`, :func:`was_stopped_at_end`).
- ``gen<g>/group_offers/<identity>``: what a process offers of its groups as g forms (JSON). Written and read by
  the ranks (:func:`offer_groups`, :func:`offered_groups`).
- ``gen<g>/moved``, ``gen<g>/lower_bound`` (counters of bytes) and ``gen<g>/shards_received/<rank>`` (JSON): what
  forming g moved. Written by the ranks (:func:`add_moved`, :func:`add_lower_bound`, :func:`record_shards`); read by
  generation rank 0 (:func:`moved_bytes`, :func:`lower_bound_bytes`, :func:`received_shards`).
- ``saved/<k>`` and ``gen<g>/evaluated/<split>/<k>[/final]``: iteration k's checkpoint was saved, an evaluation
  completed (JSON). Written and read by the ranks (:func:`mark_saved`, :func:`is_saved`, :func:`mark_evaluated`,
  :func:`evaluation_record`).

Node stores also hold copies of other owners' keys: a node's relay writes the pairs a generation's end or the root
names (:func:`copy`), unread in between.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional, Sequence

PREFIX = "elastic/"
STOP = PREFIX + "stop"
"""Set by the controller when the job must end (a failure NTP cannot absorb); the value says why."""


def process_group_prefix(generation: int) -> str:
    """The store prefix under which generation ``generation``'s process groups rendezvous."""
    return f"gen{generation}/"


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


NO_BEAT = json.dumps({"t": 0.0})
"""A heartbeat key's value before the rank's first beat (time 0: no beat yet)."""


def group_offers(generation: int, identity: tuple[int, ...]) -> str:
    """What the process with ``identity`` offers of its groups as generation ``g`` forms
    (:func:`ntp_megatron.plan.group_plan.keep_verdict`)."""
    return f"{PREFIX}gen{generation}/group_offers/{'-'.join(map(str, identity))}"


def node_beat(node_rank: int) -> str:
    """Two-level control plane: a node relay's heartbeat in the root store (JSON ``{"t", "ranks"}``), one per node
    instead of one per rank."""
    return f"{PREFIX}node_hb/{node_rank}"


def heartbeat(launch_rank: int) -> str:
    """JSON written by a rank's heartbeat thread (:class:`ntp_megatron.elastic.watchdog.Heartbeat`): when
    (``t``), the iteration and phase, its progress count and since when it waits on a collective."""
    return f"{PREFIX}hb/{launch_rank}"


WAITS = PREFIX + "waits"
"""JSON ``{launcher: [waiter, ...]}``: each launcher's ranks that have waited on their peers at least half
``ntp.heartbeat_timeout_s``, with the collectives they entered per group (:class:`ntp_megatron.elastic.blame.Waiter`);
every launcher fences its own ranks that hold one of them up (:class:`ntp_megatron.elastic.agent.Agent`). An entry
lasts while its waits do: its launcher empties it when they end."""


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


def copy(store: Any, pairs: Sequence[tuple[str, Any]]) -> None:
    """Write other owners' keys and values into a node's store in one request (the store applies it whole, so
    nothing of it is seen before the rest): what a generation's end or the root names, copied by the node's relay."""
    store.multi_set([key for key, _ in pairs], [value for _, value in pairs])


# -- the end of a generation, the end of the job ----------------------------------------------------------------------

def stop(store: Any, reason: str) -> None:
    """Controller side: the job ends, for ``reason``."""
    store.set(STOP, reason)


def is_stopped(store: Any) -> bool:
    return store.check([STOP])


def stop_reason(store: Any) -> str:
    """Why the job stopped (waits, within the store's timeout, until it has)."""
    return store.get(STOP).decode()


def stop_in_root(root: Any) -> list[tuple[str, bytes]]:
    """A node's relay: the stop as a key and value to copy, in one request; empty if the job goes on."""
    value = read_if_set(root, STOP)
    return [(STOP, value)] if value is not None else []


def end(store: Any, generation: int, value: str | bytes) -> None:
    """Mark ``generation`` over: ``value`` names the dead (:func:`abort_value`), or is :data:`MOVED` or ``stop``."""
    store.set(abort(generation), value)


def is_ended(store: Any, generation: int) -> bool:
    return store.check([abort(generation)])


def wait_end(store: Any, generation: int, timeout: Optional[timedelta] = None) -> None:
    """Wait until ``generation`` is over (raises the store's error at ``timeout``, or the store's own timeout)."""
    if timeout is None:
        store.wait([abort(generation)])
    else:
        store.wait([abort(generation)], timeout)


def end_value(store: Any, generation: int) -> bytes:
    """What ``generation``'s end says (waits, within the store's timeout, until it is over)."""
    return store.get(abort(generation))


# -- liveness ---------------------------------------------------------------------------------------------------------

def beat(store: Any, launch_rank: int, record: dict) -> None:
    """A rank's heartbeat (:func:`ntp_megatron.elastic.watchdog.beat`)."""
    store.set(heartbeat(launch_rank), json.dumps(record))


def reset_beat(store: Any, launch_rank: int) -> None:
    """The launcher, as a new process takes over ``launch_rank``: no beat yet."""
    store.set(heartbeat(launch_rank), NO_BEAT)


def place_beat(store: Any, launch_rank: int) -> None:
    """The launcher, the first time it polls ``launch_rank``: no beat yet, unless the rank beat already."""
    store.compare_set(heartbeat(launch_rank), "", NO_BEAT)


def beats(store: Any, launch_ranks: Sequence[int]) -> list[dict]:
    """The last heartbeat of each of ``launch_ranks``, in one request (each must be placed)."""
    return [json.loads(raw.decode()) for raw in store.multi_get([heartbeat(r) for r in launch_ranks])]


def beat_node(root: Any, node_rank: int, ranks: Any) -> None:
    """A node relay's heartbeat in the root: when, and its ranks' state."""
    root.set(node_beat(node_rank), json.dumps({"t": time.time(), "ranks": ranks}))


def node_beats(root: Any, node_ranks: Sequence[int]) -> list[bytes]:
    """The node relays' heartbeats as stored, in one request."""
    return root.multi_get([node_beat(n) for n in node_ranks])


def publish_waits(store: Any, launcher: str, waiters: list) -> None:
    """A launcher's entry in :data:`WAITS`: its waiting ranks (JSON-ready), or none (``[]``: the entry goes). Only
    this launcher's entry changes, whatever the others write meanwhile (``compare_set`` until it holds)."""
    current = store.get(WAITS) if store.check([WAITS]) else b""
    while True:
        table = json.loads(current.decode()) if current else {}
        if waiters:
            table[launcher] = waiters
        elif launcher in table:
            del table[launcher]
        else:
            return
        wanted = json.dumps(table, sort_keys=True).encode()
        current = bytes(store.compare_set(WAITS, current, wanted))
        if current == wanted:
            return


def published_waits(store: Any) -> list:
    """Every launcher's waiting ranks (JSON-ready, as published), in one list."""
    if not store.check([WAITS]):
        return []
    raw = store.get(WAITS)
    return [waiter for entry in (json.loads(raw.decode()) if raw else {}).values() for waiter in entry]


# -- what the ranks report --------------------------------------------------------------------------------------------

def record_failure(store: Any, launch_rank: int, spec: Any) -> None:
    """A rank, just before an injected failure: which spec, where, when; then that it fired."""
    store.set(failure(launch_rank), json.dumps({"spec": str(spec), "phase": spec.phase, "iteration": spec.iteration,
                                                "time": time.time(), "pid": os.getpid()}))
    store.set(fired(str(spec)), "1")


def armed(launch_rank: int) -> str:
    return f"{PREFIX}armed/{launch_rank}"


def arm(store: Any, launch_rank: int, draw: dict) -> None:
    """The launcher: ``launch_rank`` is to fail as ``draw`` says (a random draw, :class:`ntp_megatron.faults.Draw`)."""
    store.set(armed(launch_rank), json.dumps(draw))


def is_armed(store: Any, launch_rank: int) -> bool:
    """Whether ``launch_rank`` has not yet taken the draw it was armed with."""
    return store.check([armed(launch_rank)])


def take_armed(store: Any, launch_rank: int) -> Optional[dict]:
    """The rank, at an iteration's start: the draw it was armed with, if any, deleted as it is read."""
    key = armed(launch_rank)
    if not store.check([key]):
        return None
    raw = store.get(key)
    store.delete_key(key)
    return json.loads(raw.decode())


def disarm(store: Any, launch_rank: int) -> None:
    """The launcher, as a new process takes ``launch_rank`` over: an armed draw the old process never took is not the
    new one's."""
    store.delete_key(armed(launch_rank))


def injected_failure(store: Any, launch_rank: int, pid: Optional[int] = None) -> Optional[dict]:
    """What an injected failure recorded just before it happened, if any (``pid``: of that process only — a record of
    an earlier process of the launch rank is not a replacement's, and is kept for the report of its own death)."""
    if not store.check([failure(launch_rank)]):
        return None
    record = json.loads(store.get(failure(launch_rank)).decode())
    return None if pid and record.get("pid", pid) != pid else record  # pid 0 or None: not known


def has_fired(store: Any, spec: Any) -> bool:
    return store.check([fired(str(spec))])


def mark_fired(store: Any, spec: Any) -> None:
    """The launcher, into a fresh store after a restart: ``spec`` fired before it."""
    store.set(fired(str(spec)), "1")


def record_error(store: Any, launch_rank: int, record: dict) -> None:
    """A rank whose own code failed, just before it exits (:func:`ntp_megatron.elastic.errors.report`); with its pid."""
    store.set(rank_error(launch_rank), json.dumps({**record, "pid": os.getpid()}))


def error_record(store: Any, launch_rank: int, pid: Optional[int] = None) -> Optional[dict]:
    """What ``launch_rank`` reported of its own error, if it did (``pid``: that process — an earlier process of the
    launch rank, say one of a node declared lost that ran on for a moment, does not speak for its replacement)."""
    if not store.check([rank_error(launch_rank)]):
        return None
    record = json.loads(store.get(rank_error(launch_rank)).decode())
    return None if pid and record.get("pid", pid) != pid else record  # pid 0 or None: not known


def announce_joining(store: Any, launch_rank: int) -> None:
    """A replacement process is up and ready to be admitted."""
    store.set(joining(launch_rank), json.dumps({"time": time.time(), "pid": os.getpid()}))


def is_joining(store: Any, launch_rank: int) -> bool:
    return store.check([joining(launch_rank)])


def withdraw_joining(store: Any, launch_rank: int) -> None:
    """Node 0's launcher: ``launch_rank``'s announcement is dealt with (admitted, or it died)."""
    store.delete_key(joining(launch_rank))


def mark_stopped_at_end(store: Any, launch_rank: int, pid: int) -> None:
    store.set(stopped_at_end(launch_rank), str(pid))


def was_stopped_at_end(store: Any, launch_rank: int) -> bool:
    return store.check([stopped_at_end(launch_rank)])


def offer_groups(store: Any, generation: int, identity: tuple[int, ...], offers: dict) -> None:
    store.set(group_offers(generation, identity), json.dumps(offers))


def offered_groups(store: Any, generation: int, identity: tuple[int, ...]) -> dict:
    """What ``identity`` offers of its groups as ``generation`` forms (waits within the store's timeout)."""
    return json.loads(store.get(group_offers(generation, identity)))


def add_moved(store: Any, generation: int, received: int) -> None:
    store.add(moved(generation), received)


def moved_bytes(store: Any, generation: int) -> int:
    return int(store.add(moved(generation), 0))


def add_lower_bound(store: Any, generation: int, lacking: int) -> None:
    store.add(lower_bound(generation), lacking)


def lower_bound_bytes(store: Any, generation: int) -> int:
    return int(store.add(lower_bound(generation), 0))


def record_shards(store: Any, generation: int, rank: int, moves: list) -> None:
    store.set(shards_received(generation, rank), json.dumps(moves))


def received_shards(store: Any, generation: int, rank: int) -> list:
    """What ``rank`` of ``generation`` recorded it received (:func:`record_shards`; waits within the timeout)."""
    return json.loads(store.get(shards_received(generation, rank)).decode())


def mark_saved(store: Any, iteration: int) -> None:
    store.set(saved(iteration), "1")


def is_saved(store: Any, iteration: int) -> bool:
    return store.check([saved(iteration)])


def mark_evaluated(store: Any, generation: int, iteration: int, split: str, final: bool, record: dict) -> None:
    store.set(evaluated(generation, iteration, split, final), json.dumps(record))


def evaluation_record(store: Any, generation: int, iteration: int, split: str, final: bool) -> Optional[dict]:
    key = evaluated(generation, iteration, split, final)
    return json.loads(store.get(key)) if store.check([key]) else None


def quietly(read: Callable[..., Any], *args: Any, default: Any = None) -> Any:
    """``read(*args)``, or ``default`` if the store fails (unreachable on a failing node, gone at the end of the
    run): for launchers, whose reporting must not crash."""
    try:
        return read(*args)
    except Exception:  # noqa: BLE001 - the store may be unreachable; reporting must not crash
        return default
