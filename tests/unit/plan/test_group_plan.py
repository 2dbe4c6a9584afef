"""Which groups a rank keeps and makes across a kill, a rejoin and a dropped replica (ntp_megatron.plan.group_plan),
from the topologies alone: healthy replicas keep their tensor-parallel groups; only groups whose members changed
are made; every member of a group reaches the same plan for it; the members' verdict keeps a group only if
nothing can be left half-matched in it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_megatron.plan import optimizer_shards as shards
from ntp_megatron.plan import stages
from ntp_megatron.plan.group_plan import (GroupKey, Offer, blocked_by, event_plan, intra_group_ranks, keep_verdict, key,
                                         rank_group_calls, rank_group_keys, sync_group_ranks)
from ntp_megatron.plan.layout import make_topology
from ntp_megatron.plan.stages import JobTopology, join_topology, next_topology, with_generation

UNITS = {"heads": 8, "ffn": 24, "vocab": 29}


def roles(keys) -> list[str]:
    return sorted(k.name() for k in keys)


def make_job(*args, **kwargs) -> JobTopology:
    """A job without pipeline stages."""
    return JobTopology.one_stage(make_topology(*args, **kwargs))


def identities_of(topology) -> list[tuple[int, ...]]:
    return [topology.slot_of(r) for r in topology.ranks]


def test_a_kill_leaves_healthy_replicas_their_tensor_parallel_groups():
    """TP4 × DP2, replica 1 loses slot 3: replica 0 keeps everything but sync group 3 (its member in replica 1
    goes from slot 3 to the proxy of block 3); replica 1 makes its TP group and the sync group of block 3 on
    the proxy, and keeps the sync groups of its live slots."""
    old = make_job(4, 2, UNITS)
    new = next_topology(old, [old.rank_of(1, 3)])
    proxy = new.only_stage.proxy(1, 3)  # a slot
    for slot in range(4):
        plan = event_plan(old, new, (0, slot))
        assert roles(plan.make) == (["sync[0, 3]"] if slot == 3 else [])
        assert roles(plan.keep) == sorted(["alone[]", "tp[0]", f"sync[0, {slot}]"] if slot != 3 else ["alone[]", "tp[0]"])
        assert plan.release == ((plan.release[0],) if slot == 3 else ())
    for slot in range(3):
        plan = event_plan(old, new, (1, slot))
        made = ["tp[0]"] + (["sync[0, 3]"] if slot == proxy else [])
        assert roles(plan.make) == sorted(made)
        assert roles(plan.keep) == ["alone[]", f"sync[0, {slot}]"]
        assert roles(plan.release) == ["tp[0]"]
    dead = event_plan(old, new, (1, 3))
    assert dead.keep == dead.make == () and roles(dead.release) == ["alone[]", "sync[0, 3]", "tp[0]"]


def test_a_rejoin_makes_the_returning_replicas_groups_and_its_blocks_sync_group_only():
    old = next_topology(make_job(4, 2, UNITS), [7])
    new = join_topology(old, [(1, 3)])
    assert new.only_stage.is_healthy(1)
    for slot in range(4):
        assert roles(event_plan(old, new, (0, slot)).make) == (["sync[0, 3]"] if slot == 3 else [])
        assert "tp[0]" in roles(event_plan(old, new, (0, slot)).keep)
        made = roles(event_plan(old, new, (1, slot)).make)
        assert "tp[0]" in made and set(made) <= {"tp[0]", "sync[0, 3]", "alone[]"}
    assert roles(event_plan(old, new, (1, 3)).make) == ["alone[]", "sync[0, 3]", "tp[0]"]  # a new process


def test_a_dropped_replica_makes_every_sync_group_anew_and_keeps_every_tensor_parallel_group():
    old = make_job(2, 3, UNITS)
    new = next_topology(old, [old.rank_of(2, 0), old.rank_of(2, 1)], policy="drop_replica")
    assert [rep.index for rep in new.only_stage.replicas] == [0, 1]
    for replica in (0, 1):
        for slot in (0, 1):
            plan = event_plan(old, new, (replica, slot))
            assert roles(plan.make) == [f"sync[0, {slot}]"] and roles(plan.keep) == ["alone[]", "tp[0]"]


def test_with_pipeline_stages_a_kill_in_one_stage_leaves_the_other_stage_every_group_but_the_replicas():
    """PP2: replica 1 loses stage 1's slot 1. Stage 0 keeps its TP and sync groups; the model-parallel group of
    replica 1 (every stage) loses a member and is made anew."""
    old = stages.make_pipeline_topology(2, 2, 2, UNITS)
    new = stages.next_topology(old, [old.rank_of(1, 1, 1)])
    for slot in (0, 1):
        assert roles(event_plan(old, new, (1, slot, 0)).make) == ["mp[1]"]
        assert roles(event_plan(old, new, (0, slot, 0)).make) == []
        assert roles(event_plan(old, new, (0, slot, 1)).make) == (["sync[1, 1]"] if slot == 1 else [])
    assert roles(event_plan(old, new, (1, 0, 1)).make) == ["mp[1]", "sync[1, 1]", "tp[1]"]


@st.composite
def event_chains(draw):
    """A healthy TP × DP topology and up to three events after it (kills, with either policy, and rejoins):
    every (generation, next generation) pair of the chain."""
    tp, dp = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    topology = make_job(tp, dp, UNITS)
    pairs = []
    for _ in range(draw(st.integers(1, 3))):
        present = set(topology.replica_indices)
        dead_slots = [(r, s) for r in sorted(present) for s in range(tp) if topology.rank_of(r, s) is None]
        if dead_slots and draw(st.booleans()):
            following = join_topology(topology, [draw(st.sampled_from(dead_slots))])
        else:
            victim = draw(st.sampled_from(list(topology.ranks)))
            try:
                following = next_topology(topology, [victim], policy=draw(st.sampled_from(["drop_replica", "stop"])))
            except ValueError:  # beyond what NTP absorbs (the last rank, or below min_tp): the chain ends
                break
        following = with_generation(following, topology.generation + 1)
        pairs.append((topology, following))
        topology = following
    return pairs


@settings(max_examples=150, deadline=None)
@given(event_chains())
def test_every_member_of_a_group_plans_it_alike(pairs):
    """For every group a rank is in, every member lists the same group (so all members offer it, or none);
    a rank's plan covers exactly the groups it is in; a group is offered to go on only if its members are the
    same processes as before (none of them dead, none new)."""
    for old, new in pairs:
        _check_plans(old, new)


def _check_plans(old, new) -> None:
    for rank in new.ranks:
        wanted = rank_group_keys(new, rank)
        for k in wanted:
            for member in k.members:
                assert k in rank_group_keys(new, new.rank_of(*member))
        plan = event_plan(old, new, new.slot_of(rank))
        assert sorted(plan.keep + plan.make) == sorted(wanted)
        old_ids = set(identities_of(old))
        for k in plan.keep:
            assert set(k.members) <= old_ids


def test_groups_with_a_dead_member_are_the_ones_shut_at_once():
    old = make_job(2, 2, UNITS)
    keys = rank_group_keys(old, old.rank_of(0, 1))
    assert roles(blocked_by(keys, [(1, 1)])) == ["sync[0, 1]"]
    assert roles(blocked_by(keys, [(0, 0)])) == ["tp[0]"]
    assert blocked_by(keys, [(1, 0)]) == []


@pytest.mark.parametrize("offers, kept", [
    ({(0, 0): Offer(0, 12), (0, 1): Offer(0, 12)}, True),
    ({(0, 0): Offer(0, 12), (0, 1): Offer(0, 11)}, False),  # one member walked away from the 12th collective
    ({(0, 0): Offer(0, 12), (0, 1): Offer(2, 12)}, False),  # another incarnation (made again in generation 2)
    ({(0, 0): Offer(0, 0), (0, 1): Offer(None, 0)}, False),  # a new process holds none
    ({(0, 0): Offer(None, 0), (0, 1): Offer(None, 0)}, False),
    ({(0, 0): Offer(3, 5)}, True),
    ({}, False),
])
def test_a_group_goes_on_only_if_every_member_holds_it_alike(offers, kept):
    assert keep_verdict(offers) is kept


def test_keys_name_groups_by_identity_not_by_rank():
    old = make_job(2, 3, UNITS)
    new = next_topology(old, [old.rank_of(0, 1)])  # every rank of replicas 1 and 2 is numbered anew
    [tp_old] = [k for k in rank_group_keys(old, old.rank_of(2, 0)) if k.role == "tp"]
    [tp_new] = [k for k in rank_group_keys(new, new.rank_of(2, 0)) if k.role == "tp"]
    assert new.rank_of(2, 0) != old.rank_of(2, 0) and tp_old == tp_new
    assert isinstance(tp_old, GroupKey) and tp_old.label() == tp_new.label()


def _membership_rule(topology, rank, dp=None, k=1) -> list[GroupKey]:
    """The groups a rank is in, by the rule stated independently of the plan's enumeration: its replica stage,
    itself, its replica (with stages), the sync group of each block it serves (ascending), and per such block its
    instance's part of it and its twins' group."""
    stage = topology.stage_of(rank)
    replica = stage.replica_of(rank)
    keys = [key(topology, "tp", (stage.stage,), replica.ranks), key(topology, "alone", (), [rank])]
    if topology.num_stages > 1:
        keys.append(key(topology, "mp", (replica.index,), topology.replica_ranks(replica.index)))
    blocks = stage.member_blocks(rank)
    keys += [key(topology, "sync", (stage.stage, b), sync_group_ranks(stage, b)) for b in blocks]
    if k > 1:
        instance, position = shards.instance_of(replica.index, dp, k)
        for b in blocks:
            keys.append(key(topology, "intra", (b, instance), intra_group_ranks(stage, b, dp, k, instance)))
            keys.append(key(topology, "inter", (b, position), shards.shard_holders(stage, dp, k, (b, position))))
    return keys


@st.composite
def planned_topologies(draw):
    """A topology with dead slots: flat with 1-3 distributed-optimizer instances, or with 2-3 pipeline stages."""
    tp, k = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 3]))
    pp = draw(st.sampled_from([1, 1, 2, 3])) if k == 1 else 1
    dp = k * draw(st.integers(1, 3))
    slots = [(r, s, p) for r in range(dp) for s in range(1, tp) for p in range(pp)]  # slot 0 stays
    dead = draw(st.lists(st.sampled_from(slots), unique=True, max_size=3)) if slots else []
    if pp == 1:
        return make_job(tp, dp, UNITS, dead_slots=[(r, s) for r, s, _ in dead]), dp, k
    return stages.make_pipeline_topology(tp, dp, pp, UNITS, dead_slots=dead), dp, k


@settings(max_examples=100, deadline=None)
@given(planned_topologies())
def test_the_plan_is_one_call_sequence_every_rank_shares_and_its_members_are_the_rule(case):
    """The groups every rank makes whether a member or not come in one order on every rank, after as many
    groups made by their members alone on every rank (torch's condition for naming a group alike on all its
    members); a rank's member calls are the groups the membership rule names, in that order."""
    topology, dp, k = case
    sequences = set()
    for rank in range(topology.world_size):
        calls = rank_group_calls(topology, rank, dp, k)
        local = [c for c in calls if c.how != "every_rank"]
        assert calls[:len(local)] == local, "the groups made by members alone come first"
        assert [c.how for c in local] == ["first", "alone"] + (["part"] if topology.num_stages > 1 else [])
        assert all(rank in c.ranks and c.key is not None for c in local)
        shared = [c for c in calls if c.how == "every_rank"]
        sequences.add(tuple(c.ranks for c in shared))
        assert all((c.key is not None) == (rank in c.ranks) for c in shared)
        assert rank_group_keys(topology, rank, dp, k) == [c.key for c in calls if c.key is not None] \
            == _membership_rule(topology, rank, dp, k)
    assert len(sequences) == 1, "every rank makes the shared groups in one order"
