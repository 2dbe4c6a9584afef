"""A rank's collective sequence numbers per process group, and what it waits on: what its heartbeat reports for
the causal hang detection (:mod:`ntp_megatron.elastic.blame`).

Which groups. The groups of the rank's current generation that its training runs on (tensor-parallel, sync,
model-parallel, distributed-optimizer groups: the pooled groups of :mod:`ntp_megatron.core.groups`), tracked from
when the rank formed a generation (:func:`track`) until it leaves it (:func:`untrack`). Each has an id that is the
same on every member and names its incarnation: role and place, a digest of its members' identities, the
generation that made it (:func:`group_id`). Not tracked: the generation's default group, which an iteration's work
does not use (a re-formation's unit moves and pipeline messages run on it, point to point).

Where the numbers come from (``ntp.collective_sequences``, :func:`install`):

- ``torch`` (gloo; ``auto`` there): how many collectives the rank *entered* on a group is torch's per-group
  sequence number (``ProcessGroup._get_sequence_number_for_group``, what the keep verdict compares too) less the
  point-to-point messages our code posted on it (torch counts each message; a degraded replica's proxy posts more
  than its peers: :func:`ntp_megatron.phases.posted_point_to_point`). A gloo collective is entered when the host
  issues it, so that count is exact, coalesced operations included (one each, alike on every member). Recording
  (group, number) at issue time instead would mean wrapping every entry point of ``torch.distributed`` that
  Megatron-Core's DDP, its layers and ours call, and one missed would misname a wait; the per-group count misses
  nothing. Whether the rank waits, and since when, is its host's wait mark (:class:`ntp_megatron.phases.waiting`,
  set by the patched ``Work.wait``): the wait cannot name its group, so the rule compares the waiter with each
  member on every group they share (why that is still causal: :mod:`ntp_megatron.elastic.blame`).
- ``flight_recorder`` (NCCL; ``auto`` there): torch's flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, with
  ``TORCH_NCCL_ENABLE_TIMING=1`` so that it records when a collective *started* on the device), read through its
  dump API (``_dump_nccl_trace``, or ``_dump_fr_trace``) at every heartbeat: per group the last collective
  enqueued, started and completed. On NCCL a host wait blocks nothing (``Work.wait`` only orders streams), so the
  host's wait mark says nothing; the device does: a collective started and not completed is what the rank waits
  for, named exactly (group, number), since this source first saw it so (its own monotonic clock). Entered is
  *started*. The device's progress (completed collectives) is added to the rank's progress count: a rank whose
  host blocked in a stream synchronisation behind a working device is not still. Never run on a GPU here (tested
  over fake dumps, ``tests/unit/elastic/test_sequences.py``, and over gloo's real flight recorder, which records no
  start: there the source falls back to enqueued counts and host waits, as ``torch`` does).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from ntp_megatron import phases
from ntp_megatron.elastic.blame import Wait
from ntp_megatron.plan.group_plan import GroupKey

logger = logging.getLogger(__name__)

CHOICES = ("auto", "torch", "flight_recorder")
FLIGHT_RECORDER_ENTRIES = 2000
"""Flight-recorder ring size set where the environment sets none (torch's NCCL default)."""


def group_id(key: GroupKey, made_in: int) -> str:
    """A group's id in heartbeats: role and place (readable), its members (a digest) and its incarnation."""
    digest = hashlib.sha1(repr(key.members).encode()).hexdigest()[:8]
    return f"{key.name()}:{digest}@{made_in}"


@dataclass(frozen=True)
class Tracked:
    gid: str
    group: Any
    """The torch ProcessGroup."""


@dataclass
class Reading:
    """One read of a source: collectives entered per group id, the rank's wait, the device's progress."""

    groups: dict[str, int] = field(default_factory=dict)
    wait: Optional[Wait] = None
    device_progress: int = 0


class Source(Protocol):
    name: str

    def read(self, tracked: Sequence[Tracked]) -> Reading: ...


def host_wait(now: Optional[float] = None) -> Optional[Wait]:
    """The main thread's wait on its peers as the host sees it (gloo: a wait blocks it), on no named group."""
    since = phases.wait_state()
    if since is None:
        return None
    return Wait(max(0.0, (time.monotonic() if now is None else now) - since))


class TorchSequences:
    """``torch``: torch's per-group sequence numbers less our point-to-point messages, and host waits."""

    name = "torch"

    def read(self, tracked: Sequence[Tracked]) -> Reading:
        groups = {}
        for t in tracked:
            try:
                groups[t.gid] = t.group._get_sequence_number_for_group() - phases.point_to_point(t.group)
            except Exception:  # noqa: BLE001 - a group being let go of: no count to report
                continue
        return Reading(groups, host_wait())


def default_dump(entries: bool) -> bytes:
    """The flight recorder's state (NCCL's where this torch has it), with its entries (no stacks) or without."""
    import torch._C._distributed_c10d as c10d  # here: only a rank that reads the flight recorder needs its API

    dump = getattr(c10d, "_dump_nccl_trace", None) or c10d._dump_fr_trace
    return dump(entries, False, False)


class FlightRecorderSequences:
    """``flight_recorder``: per group, the last collective enqueued, started and completed, from torch's flight
    recorder (``dump(entries)`` returns its pickled state: ``pg_status`` by the recorder's id of each process group
    and, with ``entries``, the records that name each id's group; they are read only while a tracked group's id is
    not known yet)."""

    name = "flight_recorder"

    def __init__(self, dump: Callable[[bool], bytes] = default_dump,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dump = dump
        self.clock = clock
        self.pg_ids: dict[str, str] = {}
        """Group id -> the recorder's id for that group (its backend's ``uid`` on NCCL, else learnt from entries)."""
        self.started_waiting: dict[tuple[str, int], float] = {}
        """(group id, collective) -> when this source first saw it started and not completed."""
        self.sought: Optional[frozenset[str]] = None
        """The tracked groups whose recorder id was still unknown after the last read of the entries."""
        self.seen: set[str] = set()
        """The recorder ids in ``pg_status`` at that read: a group that has recorded nothing yet is in no entry, and
        the entries (up to 2000) are read again only once a new id shows it recorded something."""

    def read(self, tracked: Sequence[Tracked]) -> Reading:
        for t in tracked:
            uid = backend_uid(t.group)
            if uid is not None:
                self.pg_ids[t.gid] = uid
        try:
            state = self._state(tracked)
        except Exception as exc:  # noqa: BLE001 - no recorder (not enabled): report nothing rather than fail
            logger.debug("flight recorder unreadable: %s", exc)
            return Reading(wait=host_wait())
        status = state.get("pg_status", {})
        reading, waits, now = Reading(), [], self.clock()
        device_starts = False
        for t in tracked:
            s = status.get(self.pg_ids.get(t.gid, ""))
            if s is None:  # nothing recorded on it yet
                reading.groups[t.gid] = 0
                continue
            enqueued, started, completed = (int(s[k]) for k in ("last_enqueued_collective", "last_started_collective",
                                                                "last_completed_collective"))
            reading.device_progress += max(completed, 0)
            if started < 0:  # no start events (gloo, or timing off): the host enters as it enqueues
                reading.groups[t.gid] = max(enqueued, 0) - phases.point_to_point(t.group)
                continue
            device_starts = True
            reading.groups[t.gid] = started
            if started > completed:
                key = (t.gid, completed + 1)
                waits.append((self.started_waiting.setdefault(key, now), key))
        live = {key for _, key in waits}
        self.started_waiting = {k: v for k, v in self.started_waiting.items() if k in live}
        if waits:
            since, on = min(waits)
            reading.wait = Wait(now - since, on)
        elif not device_starts:
            reading.wait = host_wait()
        return reading

    def _state(self, tracked: Sequence[Tracked]) -> dict:
        """The recorder's state; with its entries, learnt from, while a tracked group's id is unknown and either the
        tracked groups changed or a group recorded something since the entries were last read (not at every beat:
        on gloo a tracked group may record nothing for long)."""
        unknown = frozenset(t.gid for t in tracked if t.gid not in self.pg_ids)
        entries = bool(unknown) and unknown != self.sought
        state = pickle.loads(self.dump(entries))
        if unknown and not entries and {str(k) for k in state.get("pg_status", {})} - self.seen:
            state, entries = pickle.loads(self.dump(True)), True
        if entries:
            self._learn(tracked, state.get("entries", ()))
            self.sought = frozenset(t.gid for t in tracked if t.gid not in self.pg_ids)
            self.seen = {str(k) for k in state.get("pg_status", {})}
        return state

    def _learn(self, tracked: Sequence[Tracked], entries: Iterable[dict]) -> None:
        """Recorder ids of tracked groups from the entries that name them. A name can come back (a group made
        anew with the same ranks): the newest id not already another incarnation's is this one's; none while the
        new group has recorded nothing (its count is 0 then)."""
        named: dict[str, set[str]] = {}
        for entry in entries:
            named.setdefault(str(entry["process_group"][0]), set()).add(str(entry["pg_id"]))
        for t in tracked:
            if t.gid in self.pg_ids:
                continue
            taken = set(self.pg_ids.values())
            ids = named.get(str(getattr(t.group, "group_name", "")), set()) - taken
            if ids:
                self.pg_ids[t.gid] = max(ids, key=int)


def backend_uid(group: Any) -> Optional[str]:
    """The flight recorder's id of ``group``'s NCCL backend (``ProcessGroupNCCL.uid``), None elsewhere."""
    try:
        import torch  # here: only a rank that reads the flight recorder needs it

        return str(group._get_backend(torch.device("cuda")).uid)
    except Exception:  # noqa: BLE001 - no NCCL backend (gloo, a fake): the entries name it
        return None


_source: Source = TorchSequences()
_tracked: tuple[Tracked, ...] = ()


def choose(choice: str, backend: str) -> str:
    """The source ``ntp.collective_sequences`` names on ``backend`` (``auto``: the flight recorder on NCCL)."""
    if choice not in CHOICES:
        raise ValueError(f"unknown collective sequence source {choice!r} (one of {', '.join(CHOICES)})")
    if choice == "auto":
        return "flight_recorder" if backend == "nccl" else "torch"
    return choice


def environment(source: str, backend: str) -> dict[str, str]:
    """What the environment must say before the first process group for ``source`` to work."""
    if source != "flight_recorder":
        return {}
    size = str(FLIGHT_RECORDER_ENTRIES)
    env = {"TORCH_FR_BUFFER_SIZE": size}
    if backend == "nccl":
        env.update(TORCH_NCCL_TRACE_BUFFER_SIZE=size, TORCH_NCCL_ENABLE_TIMING="1")
    return env


def install(choice: str, backend: str) -> Source:
    """Pick this rank's source and set what its environment needs (unless already set): before any process group."""
    global _source
    name = choose(choice, backend)
    for key, value in environment(name, backend).items():
        os.environ.setdefault(key, value)
    _source = FlightRecorderSequences() if name == "flight_recorder" else TorchSequences()
    return _source


def track(groups: Iterable[Tracked]) -> None:
    """The groups of the generation the rank just formed (replacing the previous ones)."""
    global _tracked
    _tracked = tuple(groups)


def untrack() -> None:
    """The rank leaves its generation: nothing to report until it forms the next (and no reference kept)."""
    global _tracked
    _tracked = ()


def tracked_of(pool: Any) -> list[Tracked]:
    """The groups of a generation's pool (:class:`ntp_megatron.core.groups.GroupPool`) to track."""
    return [Tracked(group_id(key, pooled.made_in), pooled.group) for key, pooled in list(pool.groups.items())]


def report() -> dict:
    """The heartbeat's share: ``seq`` (group id -> collectives entered), ``wait`` (JSON of
    :class:`ntp_megatron.elastic.blame.Wait`, or None) and ``device`` (collectives completed on the device)."""
    try:
        reading = _source.read(_tracked)
    except Exception as exc:  # noqa: BLE001 - a heartbeat must go on whatever the source does
        logger.debug("collective sequences unreadable: %s", exc)
        reading = Reading(wait=host_wait())
    return {"seq": reading.groups, "wait": reading.wait.to_json() if reading.wait is not None else None,
            "device": reading.device_progress}
