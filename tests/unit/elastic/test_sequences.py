"""Where a rank's collective sequence numbers come from (:mod:`ntp_megatron.elastic.sequences`).

The NCCL source (torch's flight recorder with start events) cannot run here — no GPU: it is tested over fake dumps
shaped as torch 2.13's ``_dump_nccl_trace`` pickles them (``pg_status`` by process-group id, ``entries`` naming each
id's group), and over gloo's real flight recorder, which has the same dump but records no start."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import pytest

from ntp_megatron import phases
from ntp_megatron.elastic import sequences
from ntp_megatron.elastic.sequences import FlightRecorderSequences, Tracked, TorchSequences, group_id
from ntp_megatron.plan.group_plan import GroupKey


class FakeGroup:
    """A process group as the sources read it: its name and torch's sequence number."""

    def __init__(self, name: str, seq: int = 0) -> None:
        self.group_name, self.seq = name, seq

    def _get_sequence_number_for_group(self) -> int:
        return self.seq


def test_torch_counts_collectives_less_our_point_to_point_messages():
    """torch counts a proxy's receives from each peer; what is compared is the collectives alone."""
    tp, sync = FakeGroup("tp", 7), FakeGroup("sync", 3)
    phases.posted_point_to_point(tp, 3)
    reading = TorchSequences().read([Tracked("tp@0", tp), Tracked("sync@0", sync)])
    assert reading.groups == {"tp@0": 4, "sync@0": 3} and reading.wait is None
    with phases.waiting():
        assert TorchSequences().read([]).wait.on is None, "a host wait names no group"


def test_a_group_s_id_is_its_members_and_its_incarnation():
    key = GroupKey("tp", (0,), ((1, 0), (1, 1)))
    other_replica = GroupKey("tp", (0,), ((0, 0), (0, 1)))
    assert group_id(key, 0) == group_id(GroupKey("tp", (0,), ((1, 0), (1, 1))), 0)
    assert group_id(key, 0).startswith("tp[0]:") and group_id(key, 0).endswith("@0")
    assert len({group_id(key, 0), group_id(key, 1), group_id(other_replica, 0)}) == 3


@dataclass
class _Pooled:
    group: object
    made_in: int


@dataclass
class _Pool:
    groups: dict = field(default_factory=dict)


def test_the_heartbeat_reports_the_tracked_groups_until_the_rank_leaves():
    key = GroupKey("sync", (0, 1), ((0, 1), (1, 1)))
    sequences.install("torch", "gloo")
    sequences.track(sequences.tracked_of(_Pool({key: _Pooled(FakeGroup("s", 5), 2)})))
    assert sequences.report() == {"seq": {group_id(key, 2): 5}, "wait": None, "device": 0}
    sequences.untrack()
    assert sequences.report()["seq"] == {}


def status(enqueued: int, started: int, completed: int) -> dict:
    return {"last_enqueued_collective": enqueued, "last_started_collective": started,
            "last_completed_collective": completed}


class FakeRecorder:
    """torch's flight recorder as its dump shows it: ``state[pg_id] = (enqueued, started, completed)``; entries
    exist for the groups named in ``names`` (pg_id -> group name)."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names, self.state, self.asked = names, {}, []

    def __call__(self, entries: bool) -> bytes:
        self.asked.append(entries)
        dump = {"version": "2.10", "pg_status": {k: status(*v) for k, v in self.state.items()}}
        if entries:
            dump["entries"] = [{"pg_id": int(pg), "process_group": (name, "desc"), "collective_seq_id": 1,
                                "state": "completed"} for pg, name in self.names.items()]
        return pickle.dumps(dump)


def test_nccl_names_the_collective_the_device_started_and_has_not_completed():
    recorder, t = FakeRecorder({"3": "tp-name", "4": "sync-name"}), [100.0]
    source = FlightRecorderSequences(recorder, clock=lambda: t[0])
    tracked = [Tracked("tp@0", FakeGroup("tp-name")), Tracked("sync@0", FakeGroup("sync-name"))]
    recorder.state = {"3": (12, 11, 11), "4": (3, 2, 2)}
    reading = source.read(tracked)
    assert reading.groups == {"tp@0": 11, "sync@0": 2} and reading.wait is None
    assert reading.device_progress == 13
    recorder.state = {"3": (13, 12, 11), "4": (3, 2, 2)}  # tp's collective 12 started on the device, not done
    t[0] = 101.0
    assert source.read(tracked).wait.on == ("tp@0", 12)
    t[0] = 107.5
    reading = source.read(tracked)
    assert (reading.wait.on, reading.wait.waited_s) == (("tp@0", 12), 6.5), "since this source first saw it"
    assert recorder.asked == [True, False, False], "entries only while a group's recorder id is unknown"
    recorder.state = {"3": (13, 12, 12), "4": (4, 3, 2)}  # done; the sync's next one started
    t[0] = 108.0
    reading = source.read(tracked)
    assert (reading.wait.on, reading.wait.waited_s) == (("sync@0", 3), 0.0)
    assert reading.device_progress == 14, "completed collectives are the device's progress"


def test_nccl_a_stuck_device_is_behind_and_not_waiting():
    """Its host enqueued collective 12, its device never started it (a kernel before it never returns)."""
    recorder = FakeRecorder({"3": "tp-name"})
    recorder.state = {"3": (12, 11, 11)}
    with phases.waiting():  # its host blocked in a wait: on NCCL that says nothing, the device does
        reading = FlightRecorderSequences(recorder).read([Tracked("tp@0", FakeGroup("tp-name"))])
    assert reading.groups == {"tp@0": 11} and reading.wait is None


def test_a_group_made_anew_under_the_same_name_is_not_read_as_the_old_one():
    """A re-formation makes a group of the same ranks again: torch may give it the same name, the recorder a new id.
    Until the new one records something its count is 0, not the old incarnation's."""
    recorder = FakeRecorder({"3": "tp-name"})
    recorder.state = {"3": (40, 40, 40)}
    source = FlightRecorderSequences(recorder)
    assert source.read([Tracked("tp@0", FakeGroup("tp-name"))]).groups == {"tp@0": 40}
    again = [Tracked("tp@1", FakeGroup("tp-name"))]
    assert source.read(again).groups == {"tp@1": 0}
    recorder.names["7"] = "tp-name"
    recorder.state["7"] = (2, 2, 1)
    assert source.read(again).groups == {"tp@1": 2}


def test_a_group_with_nothing_recorded_yet_has_entered_nothing():
    recorder = FakeRecorder({})
    reading = FlightRecorderSequences(recorder).read([Tracked("tp@0", FakeGroup("tp-name"))])
    assert reading.groups == {"tp@0": 0}


def test_a_group_that_records_nothing_is_not_sought_in_the_entries_at_every_beat():
    """On gloo a tracked group may record nothing for long (its id stays unknown): the recorder's entries (up to 2000)
    are read again only when a new group id shows that some group recorded something, or the tracked groups change."""
    recorder = FakeRecorder({"3": "tp-name"})
    recorder.state = {"3": (5, -1, 5)}
    source = FlightRecorderSequences(recorder)
    tracked = [Tracked("tp@0", FakeGroup("tp-name")), Tracked("quiet@0", FakeGroup("quiet-name"))]
    for _ in range(3):
        assert source.read(tracked).groups == {"tp@0": 5, "quiet@0": 0}
    assert recorder.asked == [True, False, False]
    recorder.names["4"], recorder.state["4"] = "quiet-name", (1, -1, 0)
    assert source.read(tracked).groups == {"tp@0": 5, "quiet@0": 1}
    assert recorder.asked == [True, False, False, False, True], "a new id: the entries once, in the same beat"
    source.read(tracked)
    assert recorder.asked[-1] is False


def test_without_start_events_the_host_enters_as_it_enqueues():
    """gloo's recorder (and NCCL's without TORCH_NCCL_ENABLE_TIMING) records no start: enqueued counts, less our
    point-to-point messages (counted alike), and the host's wait."""
    group = FakeGroup("gloo-name")
    phases.posted_point_to_point(group, 2)
    recorder = FakeRecorder({"1": "gloo-name"})
    recorder.state = {"1": (9, -1, 8)}
    with phases.waiting():
        reading = FlightRecorderSequences(recorder).read([Tracked("g@0", group)])
    assert reading.groups == {"g@0": 7} and reading.wait is not None and reading.wait.on is None


def test_an_unreadable_recorder_reports_no_counts():
    def broken(entries: bool) -> bytes:
        raise RuntimeError("flight recorder not enabled")

    assert FlightRecorderSequences(broken).read([Tracked("g@0", FakeGroup("g"))]).groups == {}


@pytest.mark.parametrize("choice, backend, expected", [("auto", "gloo", "torch"), ("auto", "nccl", "flight_recorder"),
                                                        ("torch", "nccl", "torch"),
                                                        ("flight_recorder", "gloo", "flight_recorder")])
def test_the_switch(choice, backend, expected):
    assert sequences.choose(choice, backend) == expected


def test_nccl_s_recorder_is_switched_on_with_start_events():
    assert sequences.environment("flight_recorder", "nccl") == {
        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_ENABLE_TIMING": "1"}
    assert sequences.environment("torch", "nccl") == {}


REAL_GLOO = textwrap.dedent("""
    import os, pickle
    from ntp_megatron.elastic import sequences
    sequences.install("flight_recorder", "gloo")  # sets TORCH_FR_BUFFER_SIZE before any process group
    import torch, torch.distributed as dist
    from ntp_megatron import phases
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    g = dist.new_group([0], use_local_synchronization=True)
    h = dist.new_group([0])
    t = torch.ones(2)
    for _ in range(5):
        dist.all_reduce(t, group=g)
    dist.all_reduce(t, group=h)
    source = sequences._source
    tracked = [sequences.Tracked("g", g), sequences.Tracked("h", h)]
    reading = source.read(tracked)
    torch_reading = sequences.TorchSequences().read(tracked)
    print(reading.groups, torch_reading.groups)
    dist.destroy_process_group()
""")


def test_gloo_s_real_flight_recorder_gives_torch_s_counts():
    """The dump of torch 2.13's own recorder (gloo: no start events) read by the source: the same counts as
    torch's sequence numbers. In a process of its own: the recorder's size is read once per process."""
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": ""}
    env.pop("TORCH_FR_BUFFER_SIZE")
    out = subprocess.run([sys.executable, "-c", REAL_GLOO], capture_output=True, text=True, timeout=50, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "{'g': 5, 'h': 1} {'g': 5, 'h': 1}", out.stdout
