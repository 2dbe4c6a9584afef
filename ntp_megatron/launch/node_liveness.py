"""Whether another node's launcher is lost, decided on node 0 from what its link said and when (pure: no sockets, no
store, no clock of its own; the caller gives node 0's monotonic time, so no wall clocks of two hosts are compared).

A node is lost when its launcher's link to node 0 closed (the launcher was SIGKILLed, its host crashed and the
kernel said so: seen within milliseconds), or when node 0 has heard nothing on it for ``ntp.node_timeout_s`` (the
host stopped: SIGSTOP of the launcher and its ranks, a hung kernel, a cut cable). Each link speaks for one
*incarnation* of a node, its launcher's pid: a replacement launcher for the same node starts a new one, and what an
incarnation that was declared lost says later (a stopped launcher resumed) never brings its node back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Loss:
    """Node ``node``'s incarnation ``pid`` is lost, for ``reason``; ``at``: when (monotonic on node 0): its link
    closed, or node 0 last heard from it."""

    node: int
    pid: int
    reason: str
    at: float


@dataclass
class _Incarnation:
    pid: int
    last_heard: float
    closed_at: Optional[float] = None


@dataclass
class NodeLiveness:
    """Node 0's view of the other nodes' launchers (one current incarnation per node)."""

    timeout_s: float
    """``ntp.node_timeout_s``: a silence this long means the node is lost."""
    _current: dict[int, _Incarnation] = field(default_factory=dict)
    _lost: set[tuple[int, int]] = field(default_factory=set)
    """(node, pid) of every incarnation declared lost."""

    def connected(self, node: int, pid: int, now: float) -> None:
        """Node ``node``'s launcher ``pid`` opened its link: it is watched from now (a new pid replaces the one
        before; a pid declared lost stays lost)."""
        if (node, pid) not in self._lost:
            self._current[node] = _Incarnation(pid, now)

    def heard(self, node: int, pid: int, now: float) -> None:
        """A beat from ``pid`` on its link."""
        current = self._current.get(node)
        if current is not None and current.pid == pid and current.closed_at is None:
            current.last_heard = now

    def closed(self, node: int, pid: int, now: float) -> None:
        """``pid``'s link closed (end of file, or an error on it)."""
        current = self._current.get(node)
        if current is not None and current.pid == pid and current.closed_at is None:
            current.closed_at = now

    def left(self, node: int, pid: int, now: float) -> None:
        """``pid`` said goodbye on its link (its launcher ended as it should): no longer watched."""
        current = self._current.get(node)
        if current is not None and current.pid == pid and current.closed_at is None:
            del self._current[node]

    def watched(self) -> dict[int, int]:
        """Node -> the pid of its watched launcher (not lost)."""
        return {node: inc.pid for node, inc in self._current.items()}

    def is_lost(self, node: int, pid: int) -> bool:
        return (node, pid) in self._lost

    def lost(self, now: float) -> list[Loss]:
        """The incarnations lost by ``now`` and not reported before (each is reported once), by node."""
        out = []
        for node, inc in sorted(self._current.items()):
            at = inc.last_heard
            if inc.closed_at is not None:
                reason, at = "its launcher's connection to node 0 closed", inc.closed_at
            elif now - inc.last_heard >= self.timeout_s:
                reason = (f"node 0 has not heard from its launcher for {now - inc.last_heard:.1f} s "
                          f"(ntp.node_timeout_s {self.timeout_s:g})")
            else:
                continue
            out.append(Loss(node, inc.pid, reason, at))
        for loss in out:
            self._lost.add((loss.node, loss.pid))
            del self._current[loss.node]
        return out
