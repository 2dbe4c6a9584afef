"""Slow ranks, the pure parts: the ``slow:`` spec, the rank's pace (Slowdown, the emulated device), and the
rebalance monitor's decisions."""

from __future__ import annotations

import pytest

from ntp_megatron import faults, phases
from ntp_megatron.config.files import ConfigError
from ntp_megatron.speed.device_model import EmulatedDevice
from ntp_megatron.plan.layout import make_topology, rebalanced_topology
from ntp_megatron.plan.rebalance import Group, RebalanceMonitor, groups_of
from ntp_megatron.plan.stages import JobTopology

pytestmark = pytest.mark.unit


def test_slow_spec_parses_and_travels_to_the_ranks():
    spec = faults.parse_failure_spec("slow:rank=1,factor=2,iter=10", world_size=8, train_iters=40)
    assert spec == faults.SlowRank(rank=1, factor=2.0, iteration=10) and str(spec) == "slow:rank=1,factor=2,iter=10"
    assert faults.parse_failure_spec("slow:rank=0,factor=1.5").iteration == 1
    env = faults.to_env([spec, faults.parse_failure_spec("kill:rank=2,iter=3")])
    assert faults.from_env({faults.ENV_FAILURES: env}) == [spec, faults.RankFailure("kill", 2, 3)]


@pytest.mark.parametrize("text, message", [
    ("slow:rank=1", "missing factor"),
    ("slow:factor=2", "missing rank"),
    ("slow:rank=1,factor=0.5", "factor must be in 1..100"),
    ("slow:rank=1,factor=2,iter=50", "past training.train_iters (40)"),
    ("slow:rank=9,factor=2", "rank must be a launch rank in 0..7"),
    ("slow:rank=1,factor=2,phase=forward", "unknown field 'phase'"),
])
def test_bad_slow_specs_name_the_field(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        faults.parse_failure_spec(text, world_size=8, train_iters=40)


class FakeClock:
    """The compute clock, moved by the test (and by the sleeps of the pace under test)."""

    def __init__(self, monkeypatch) -> None:
        self.now = 0.0
        monkeypatch.setattr(phases, "compute_clock", lambda: self.now)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_slowdown_stretches_the_passes_only(monkeypatch):
    clock = FakeClock(monkeypatch)
    slow = faults.Slowdown(1, [faults.SlowRank(1, 3.0, 2), faults.SlowRank(1, 1.0, 4), faults.SlowRank(0, 9.0, 1)],
                           sleep=clock.sleep)
    where = {"at": (1, "start")}
    monkeypatch.setattr(phases, "current", lambda: where["at"])

    def step(iteration: int, work: list[tuple[str, str, float]]) -> float:
        where["at"] = (iteration, "start")
        slow("point")
        begin = clock.now
        for phase, kind, seconds in work:
            clock.now += seconds
            where["at"] = (iteration, phase)
            slow(kind)
        return clock.now - begin

    # Work from the start mark to the first micro-batch's tick counts (here "start"), later ones in "forward"; the
    # gradient sync's point ends the passes.
    work = [("start", "micro_batch", 0.5), ("forward", "tick", 1.0), ("forward", "point", 1.0), ("grad_sync", "point", 1.0),
            ("optimizer", "point", 5.0)]
    assert step(1, work) == 8.5  # factor 1 before iteration 2 (rank 0's spec is not this rank's)
    assert step(2, work) == 15.5  # the 3.5 s of passes take 10.5 s; the optimizer step's 5 s do not stretch
    assert step(3, work) == 15.5 and slow.slept == 14.0
    assert step(4, work) == 8.5  # factor=1 ended it


def test_emulated_device_sleeps_its_share_at_training_micro_batches(monkeypatch):
    slept = []
    device = EmulatedDevice(400.0, sleep=slept.append)
    device.share = 0.25
    where = {"at": (1, "start")}
    monkeypatch.setattr(phases, "current", lambda: where["at"])
    device("micro_batch")
    device("point")  # a phase point is not a micro-batch
    where["at"] = (1, "forward")
    device("tick")  # a layer's progress mark (ntp.progress_fence) is not one either
    device("micro_batch")
    where["at"] = (1, "eval")
    device("micro_batch")
    assert slept == [0.1, 0.1] and device.busy_s == pytest.approx(0.2)


def feed(monitor: RebalanceMonitor, times: dict[int, list[float]], first: int = 1) -> None:
    for launch_rank, series in times.items():
        monitor.observe(launch_rank, [(first + i, t) for i, t in enumerate(series)])


def test_a_rank_slower_than_its_group_for_the_window_gets_a_share_in_proportion():
    topo = JobTopology.one_stage(make_topology(4, 2, {"heads": 8}))
    identity = {lr: topo.slot_of(lr) for lr in range(8)}
    monitor = RebalanceMonitor(threshold=1.2, window=3)
    feed(monitor, {lr: [1.0, 1.0, 1.0] for lr in range(8)})
    feed(monitor, {1: [1.0, 2.0, 2.0]})  # slower only in the last two: not for the whole window
    assert monitor.decide(groups_of(topo, identity)) == []
    feed(monitor, {lr: [1.0] for lr in range(8) if lr != 1} | {1: [2.0]}, first=4)
    [decision] = monitor.decide(groups_of(topo, identity))
    assert (decision.replica, decision.stage, dict(decision.weights)) == (0, 0, {0: 100, 1: 50, 2: 100, 3: 100})
    assert decision.slowness[1] == 2.0 and decision.iterations == (2, 3, 4)


def test_a_rebalanced_rank_as_fast_as_its_share_keeps_it_and_gets_it_back_once_fast():
    topo = rebalanced_topology(make_topology(2, 1, {"heads": 8}), {0: {0: 100, 1: 50}})
    monitor = RebalanceMonitor(threshold=1.2, window=2)
    groups = [Group(0, 0, {0: 0, 1: 1}, dict(topo.replica(0).weights))]
    feed(monitor, {0: [1.0, 1.0], 1: [1.0, 1.1]})  # half the work in the same time: still half as fast
    assert monitor.decide(groups) == []
    monitor.reset(after_iteration=2)
    feed(monitor, {0: [1.0, 1.0, 1.0], 1: [0.5, 0.5, 0.55]})  # iteration 1 and 2 were dropped by the reset
    assert monitor.times[0] == {3: 1.0}
    feed(monitor, {0: [1.0, 1.0], 1: [0.5, 0.52]}, first=4)
    [decision] = monitor.decide(groups)
    assert decision.weights == {}  # as fast as the other within the threshold: even again (canonical)


def test_monitor_needs_every_member_and_a_whole_window():
    monitor = RebalanceMonitor(threshold=1.5, window=2)
    feed(monitor, {0: [1.0, 1.0], 1: [3.0, 3.0]})
    assert monitor.decide([Group(0, 0, {0: 0, 1: 1, 2: 2})]) == []  # slot 2's times missing
    assert monitor.decide([Group(0, 0, {0: 0})]) == []  # one member: nothing to compare
    with pytest.raises(ValueError):
        RebalanceMonitor(threshold=1.0, window=3)


def test_ranks_holding_more_units_are_not_taken_for_slow_ones():
    """TP8 -> TP7 with 8 heads: one survivor holds 2 heads, the others 1, and takes longer for it. Speed is work per
    second, the work being the units it holds (groups_of with the model's unit costs): nobody is slow. With speed
    taken as weight per second the survivor would look 1.3x slower and be rebalanced for nothing."""
    from ntp_megatron.plan.layout import next_topology

    topo = JobTopology.one_stage(next_topology(make_topology(8, 1, {"heads": 8, "ffn": 64, "vocab": 64}), [7]))
    identity = {lr: topo.slot_of(lr) for lr in range(7)}
    costs = {0: {"heads": 300, "ffn": 10, "vocab": 5}}
    [group] = groups_of(topo, identity, costs)
    assert sorted(group.work.values())[-1] > sorted(group.work.values())[0]  # uneven work
    monitor = RebalanceMonitor(threshold=1.2, window=3)
    feed(monitor, {lr: [group.work[topo.slot_of(lr)[1]] / 1000] * 3 for lr in range(7)})  # time = work
    assert monitor.decide([group]) == []
    assert monitor.decide([Group(0, 0, group.members, {})]) != []  # what weighing by weight alone would do


def test_a_recovered_rank_gets_its_units_back_though_fixed_work_keeps_it_below_its_weight():
    """Weight 80 after a 1.25x slowdown that ended: with a third of its compute not shrinking with its units, it
    measures at 0.9 of the others' speed, not faster than its weight by the threshold; being within the threshold of
    normal, it gets 100 back (helper-5's loop kept it at 80 for good)."""
    monitor = RebalanceMonitor(threshold=1.2, window=2)
    group = Group(0, 0, {0: 0, 1: 1}, {0: 100, 1: 80}, {0: 1.0, 1: 0.8})
    feed(monitor, {0: [1.0, 1.0], 1: [0.8 / 0.9, 0.8 / 0.9]})  # speed 0.9 of the other's
    [decision] = monitor.decide([group])
    assert decision.weights == {}
    monitor = RebalanceMonitor(threshold=1.2, window=2)
    feed(monitor, {0: [1.0, 1.0], 1: [0.8 / 0.8, 0.8 / 0.8]})  # still at 0.8: as its weight says, nothing to do
    assert monitor.decide([group]) == []


def test_a_later_decision_reads_only_iterations_after_the_earlier_ones_effect():
    """A decision over iterations 3-5 takes effect at 7 at the earliest: the next decision may not weigh the slow
    rank by iterations 4-6 (still the old layout's), whatever was observed before."""
    monitor = RebalanceMonitor(threshold=1.2, window=3)
    group = Group(0, 0, {0: 0, 1: 1})
    for k in range(3, 7):
        monitor.observe(0, [(k, 1.0)])
        monitor.observe(1, [(k, 3.0)])
    [first] = monitor.decide([group])
    assert max(first.iterations) == 6
    assert monitor.decide([Group(0, 0, {0: 0, 1: 1}, first.weights)]) == []  # 4-6 do not count again
    for k in range(9, 12):  # fast again: slot 1 takes its share of the time
        monitor.observe(0, [(k, 1.0)])
        monitor.observe(1, [(k, first.weights[1] / 100)])
    [back] = monitor.decide([Group(0, 0, {0: 0, 1: 1}, first.weights)])
    assert min(back.iterations) >= 9
