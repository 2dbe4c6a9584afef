"""A generation's publication: the one place that writes what a generation is, and the one every reader goes through.

The controller (launcher of node 0) publishes generation ``g`` with :func:`publish`: its *info* (the generation it
builds on, the slots that died or join, new weights, the iteration settled, the deaths), its whole topology, then
``latest``. Everyone else reads it here: a rank (:func:`topology`, computed from the info where the rank holds the
topology it builds on, as the controller computed it), a node's relay and last voter (the info and ``latest``
copied into the node's store: :func:`copy_to_node`, :func:`published_since`), the launcher's rejoin and rebalance
requests, the control plane's load test.

This module owns the publication's keys in the control-plane store, their writers and their readers:

- ``topology/gen<g>``: generation g's topology (JSON). Written by the controller (:func:`publish`); read by whoever
  does not hold the generation g builds on (:func:`topology`).
- ``elastic/gen<g>/info``: why g exists (JSON). Written by :func:`publish`, copied into node stores
  (:func:`copy_to_node`, or with a generation's end by its relay); read by every rank (:func:`info`).
- ``elastic/latest``: the newest published generation. Written by :func:`publish`, raised in node stores
  (:func:`raise_latest`); read by everyone (:func:`latest`, :func:`newest`, :func:`is_published`).
- ``elastic/gen<g>/reform_requested``: the generation that running generation g moves to at its next committed
  iteration (an admission, a rebalance). Written by :func:`publish`; read by the last voter
  (:func:`boundary_requested`, :func:`ntp_megatron.elastic.commit.decide_iteration`).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ntp_megatron.elastic import keys
from ntp_megatron.elastic.keys import PREFIX
from ntp_megatron.plan.stages import JobTopology, published_topology

Store = Any
"""A ``torch.distributed.Store`` (root or node store): duck-typed, so this module loads without torch."""

LATEST = PREFIX + "latest"
"""The newest published generation (an integer)."""


def topology_key(generation: int) -> str:
    """JSON: generation ``generation``'s topology, published by the controller."""
    return f"topology/gen{generation}"


def info_key(generation: int) -> str:
    """JSON: why generation ``g`` exists (the dead launch ranks since the last completed generation, ...)."""
    return f"{PREFIX}gen{generation}/info"


def reform_requested_key(generation: int) -> str:
    """Set by the controller to admit repaired ranks: the rank whose vote completes the next iteration of
    generation ``g`` decides ``commit+reform``, and everyone moves to the published next generation after it."""
    return f"{PREFIX}gen{generation}/reform_requested"


def publish(store: Store, topology: JobTopology, info: dict,
            boundary_of: Optional[int] = None) -> list[tuple[str, str]]:
    """Publish ``topology``'s generation: its info, its topology, then ``latest``; with ``boundary_of``, ask that
    running generation to move to it after its next committed iteration (an admission or a rebalance). Returns what a
    node's store needs of it (info and latest), for the controller to write into the end of the generations it
    replaces."""
    g = topology.generation
    text = json.dumps(info)
    store.set(info_key(g), text)
    store.set(topology_key(g), json.dumps(topology.to_json()))
    store.set(LATEST, str(g))
    if boundary_of is not None:
        store.set(reform_requested_key(boundary_of), str(g))
    return [(info_key(g), text), (LATEST, str(g))]


# -- reading ----------------------------------------------------------------------------------------------------------

def latest(store: Store) -> int:
    """The newest published generation (waits, within the store's timeout, until generation 0 is published)."""
    return int(store.get(LATEST).decode())


def newest(store: Store) -> int:
    """The newest published generation without waiting; -1 if there is none yet."""
    value = keys.read_if_set(store, LATEST)
    return int(value.decode()) if value is not None else -1


def is_published(store: Store) -> bool:
    """Whether a generation is published (``latest`` is set)."""
    return store.check([LATEST])


def boundary_requested(store: Store, generation: int) -> bool:
    """Whether the controller asked running ``generation`` to move to a newer one at its next committed iteration."""
    return store.check([reform_requested_key(generation)])


def info(store: Store, generation: int) -> dict:
    """Why ``generation`` exists (see :func:`publish`)."""
    return json.loads(info_bytes(store, generation))


def info_bytes(store: Store, generation: int) -> bytes:
    """:func:`info` as stored (what a reader pays to read it)."""
    return store.get(info_key(generation))


def topology(store: Store, generation: int) -> JobTopology:
    """``generation``'s whole topology, as published (one read of its size: a rank that holds the generation it
    builds on computes it instead, :func:`computed`)."""
    return parsed(topology_bytes(store, generation))


def topology_bytes(store: Store, generation: int) -> bytes:
    """:func:`topology` as stored (what a reader pays to read it)."""
    return store.get(topology_key(generation))


def parsed(raw: bytes) -> JobTopology:
    """A topology from its published bytes."""
    return JobTopology.from_json(json.loads(raw))


def computed(base: JobTopology, published: dict, generation: int, min_tp: int = 1,
             policy: str = "drop_replica") -> JobTopology:
    """``generation``'s topology from the one it builds on and what its info says changed, as the controller computed
    it (:func:`ntp_megatron.plan.stages.published_topology`)."""
    return published_topology(base, published, generation, min_tp, policy)


# -- a node's copy ----------------------------------------------------------------------------------------------------

def published_since(root: Store, since: int) -> list[tuple[str, bytes | str]]:
    """What a node's store lacks of the root's publications after generation ``since``: each one's info, then
    ``latest`` (last: a rank that sees it finds the info there)."""
    newest_g = newest(root)
    out: list[tuple[str, bytes | str]] = [(info_key(g), keys.read_if_set(root, info_key(g)))
                                          for g in range(since + 1, newest_g + 1)]
    out.append((LATEST, str(newest_g)))
    return out


def copy_to_node(root: Store, local: Store, since: int = -1) -> int:
    """Copy into a node's store the generations published after ``since`` (their info, then ``latest``); returns the
    newest, or ``since`` if none is published."""
    entries = published_since(root, since)
    newest_g = int(entries[-1][1])
    for key, value in entries[:-1]:
        local.set(key, value)
    if newest_g > since:
        raise_latest(local, newest_g)
    return max(newest_g, since)


def split_latest(pairs: list[tuple[str, Any]]) -> tuple[int, list[tuple[str, Any]]]:
    """Of keys and values to copy into a node's store: the generation they name ``latest`` (-1 if none does; it is
    raised with :func:`raise_latest`, never set), and the other pairs, in order."""
    latest = max([int(value) for key, value in pairs if key == LATEST], default=-1)
    return latest, [(key, value) for key, value in pairs if key != LATEST]


def raise_latest(local: Store, generation: int) -> int:
    """Set a node store's ``latest`` to ``generation`` unless it holds a newer one; returns what it holds. Two
    writers copy it from the root (the relay, a node's last voter that brings ``commit+reform``), each from a read
    that may be older than the other's write: a plain set could take the node's ranks back to a generation already
    ended, whose end the relay does not write again."""
    want = str(generation)
    current = local.compare_set(LATEST, "", want)  # set where absent
    while int(current.decode()) < generation:
        current = local.compare_set(LATEST, current, want)
    return int(current.decode())
