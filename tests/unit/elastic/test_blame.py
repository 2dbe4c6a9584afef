"""The causal rule of hang detection (:mod:`ntp_megatron.elastic.blame`) over recorded wait and progress states.

The job of every case is TP2 x DP2: replica 0 is launch ranks 0, 1 (tensor-parallel group ``TP0``), replica 1 is
launch ranks 2, 3 (``TP1``); sync group ``S0`` is ranks 0 and 2, ``S1`` ranks 1 and 3. Counts are collectives
entered per group; ``still`` is how long a rank's progress has stood still, ``wait`` how long it has waited."""

from __future__ import annotations

import pytest

from ntp_megatron.elastic.blame import Blame, RankState, Wait, Waiter, culprits, held_up_by, suspect, waiters

PATIENCE = 5.0
TP0, TP1, S0, S1 = "tp[0]:aaaa@0", "tp[0]:bbbb@0", "sync[0, 0]:cccc@0", "sync[0, 1]:dddd@0"
MEMBERS = {0: (TP0, S0), 1: (TP0, S1), 2: (TP1, S0), 3: (TP1, S1)}


def rank(r: int, counts: tuple[int, int], phase: str = "forward", still: float = 0.0,
         wait: float | None = None, on: tuple[str, int] | None = None, iteration: int = 4) -> RankState:
    """Launch rank ``r`` with ``counts`` on (its TP group, its sync group)."""
    tp, sync = MEMBERS[r]
    return RankState(r, phase, iteration, {tp: counts[0], sync: counts[1]},
                     Wait(wait, on) if wait is not None else None, still)


def blamed(states: list[RankState]) -> list[tuple[int, int, str]]:
    """(culprit, waiter, group) for every blame, every rank's launcher publishing and judging its own."""
    return [(b.culprit, b.waiter, b.group) for b in culprits(waiters(states, PATIENCE), states, PATIENCE)]


def test_a_rank_spinning_in_forward_is_named_by_the_ranks_that_wait_on_it():
    """Launch rank 2 spins in forward: its TP peer (3) waits in TP1 for the collective 2 never entered; replica 0
    went on to the gradient sync and waits in S0 and S1 (2 and 3 are behind there). Only 2 is named, for the longest
    wait it holds up: 3 is behind 1 in S1 too and has not moved, but it waits."""
    states = [rank(0, (20, 3), "grad_sync", still=6.0, wait=6.0), rank(1, (20, 3), "grad_sync", still=6.0, wait=6.2),
              rank(2, (11, 2), still=6.1), rank(3, (12, 2), still=6.1, wait=6.1)]
    assert blamed(states) == [(2, 3, TP1)]


def test_only_the_culprit_is_named_while_another_rank_is_frozen_elsewhere():
    """Launch rank 3 waits on rank 2 in TP1. Rank 1 is frozen too (no progress, not waiting, in an iteration's
    phase) but level with or ahead of every waiter on every group it shares with one: it is not why any wait lasts."""
    states = [rank(0, (20, 2), "optimizer", still=1.0), rank(1, (20, 3), "optimizer", still=30.0),
              rank(2, (11, 2), still=6.0), rank(3, (12, 2), still=6.0, wait=6.0)]
    assert blamed(states) == [(2, 3, TP1)]


def test_a_chain_of_waits_ends_at_the_rank_that_is_really_stuck():
    """3 waits on 2 in TP1; 2 itself waits on 0 in S0; 0 makes no progress and is behind 2 there: 0 is named, not 2
    (which has not moved either, and is behind 3)."""
    states = [rank(0, (20, 2), "grad_sync", still=7.0), rank(1, (20, 2), "grad_sync", still=0.1),
              rank(2, (12, 3), "grad_sync", still=7.0, wait=6.5), rank(3, (13, 3), "grad_sync", still=7.0, wait=7.0)]
    assert blamed(states) == [(0, 2, S0)]


@pytest.mark.parametrize("case", ["slow but progressing", "outside an iteration", "waits too", "nobody waits long",
                                  "not behind"])
def test_no_one_else_is_fenced(case):
    """Rank 2 is behind its waiting peer 3 in TP1, but: it progresses (a slow rank: 20x, its marks still move), it
    is in a checkpoint write, it waits itself, 3 has waited less than the patience, or it is level with 3."""
    still = 0.4 if case == "slow but progressing" else 9.0
    phase = "checkpoint" if case == "outside an iteration" else "backward"
    wait = 9.0 if case == "waits too" else None
    waited = 4.9 if case == "nobody waits long" else 9.0
    counts = (12, 2) if case == "not behind" else (11, 2)
    states = [rank(0, (5, 2), "backward", still=0.1), rank(1, (5, 2), "backward", still=0.1),
              rank(2, counts, phase, still=still, wait=wait), rank(3, (12, 2), "backward", still=9.0, wait=waited)]
    assert blamed(states) == []


@pytest.mark.parametrize("phase", ["start", "param_gather"])
def test_a_rank_stuck_at_an_iteration_s_start_or_in_the_parameter_gather_is_named(phase):
    """An iteration runs from its start mark (the first micro-batch's data read) to the distributed optimizer's
    parameter all-gather: rank 2 stuck there, behind its waiting TP peer, is named (a soak saw ranks wait in
    param_gather on a spinning rank nobody blamed)."""
    states = [rank(0, (5, 2), "backward", still=0.1), rank(1, (5, 2), "backward", still=0.1),
              rank(2, (11, 2), phase, still=6.0), rank(3, (12, 2), "forward", still=6.0, wait=6.0)]
    assert blamed(states) == [(2, 3, TP1)]


def test_a_rank_still_setting_up_is_not_named():
    """Before its first mark a rank builds its model and datasets (``setup``: long work without marks is normal)."""
    states = [rank(2, (11, 2), "setup", still=60.0, iteration=0), rank(3, (12, 2), still=6.0, wait=6.0)]
    assert blamed(states) == []


def test_a_named_wait_blames_only_behind_in_that_group():
    """The flight recorder names the collective a rank waits for (NCCL): a member behind it in another group it
    shares is not why it waits; one behind in that group (has not started that collective) is."""
    waiter = Waiter(1, {TP0: 20, S1: 4}, Wait(6.0, (S1, 4)))
    behind_elsewhere = RankState(0, "forward", 4, {TP0: 19, S0: 4}, None, 6.0)
    assert held_up_by(waiter, behind_elsewhere) is None
    behind_there = RankState(3, "forward", 4, {TP1: 30, S1: 3}, None, 6.0)
    assert held_up_by(waiter, behind_there) == (S1, 4, 3)
    [found] = culprits([waiter], [behind_elsewhere, behind_there], PATIENCE)
    assert (found.culprit, found.group, found.seq, found.entered) == (3, S1, 4, 3)


def test_a_member_that_entered_the_waited_collective_is_level_not_behind():
    """The NCCL boundary: the waiter waits for collective 4 of S1 (started, not completed); a member that has started
    4 there too is level with it (its own device waits on someone else), not why the wait lasts."""
    waiter = Waiter(1, {TP0: 20, S1: 4}, Wait(6.0, (S1, 4)))
    level = RankState(3, "forward", 4, {TP1: 30, S1: 4}, None, 6.0)
    assert held_up_by(waiter, level) is None
    assert culprits([waiter], [level], PATIENCE) == []


def test_a_published_wait_shorter_than_the_patience_blames_no_one():
    """``culprits`` takes what the launchers published as it is: an entry under the patience (another launcher's
    older rule, a hand-made list) holds no one up yet."""
    short = Waiter(3, {TP1: 12}, Wait(PATIENCE - 0.1))
    assert culprits([short], [rank(2, (11, 2), still=9.0)], PATIENCE) == []


def test_a_rank_is_never_its_own_culprit():
    """A launcher's published entry for a rank that no longer waits may outlive its wait by a refresh
    (``timing.stall_refresh_s``): that rank, now still and not waiting, is never held up by its own wait, even on
    counts that say it is behind them (a group made anew under the same id)."""
    own = Waiter(2, {TP1: 12, S0: 3}, Wait(6.0))
    assert held_up_by(own, rank(2, (11, 2), still=9.0)) is None
    assert culprits([own], [rank(2, (11, 2), still=9.0)], PATIENCE) == []


def test_counts_are_compared_within_one_incarnation_of_a_group_only():
    """A rank that still reports TP1 as generation 0 made it is not compared with one in generation 1's TP1."""
    waiter = Waiter(3, {"tp[0]:bbbb@1": 5}, Wait(6.0))
    old = RankState(2, "forward", 4, {"tp[0]:bbbb@0": 2}, None, 6.0)
    assert culprits([waiter], [old], PATIENCE) == []
    assert suspect(old, PATIENCE)


def test_the_longest_wait_is_named_and_each_culprit_once():
    published = [Waiter(3, {TP1: 12}, Wait(6.0)), Waiter(0, {S0: 3}, Wait(8.0))]
    [found] = culprits(published, [rank(2, (11, 2), still=6.0)], PATIENCE)
    assert (found.culprit, found.waiter, found.group) == (2, 0, S0)


def test_waits_are_published_from_the_patience_on_and_survive_json():
    states = [rank(0, (1, 1), wait=PATIENCE - 0.01), rank(1, (1, 1), wait=PATIENCE, on=(S1, 2)), rank(2, (1, 1))]
    [published] = waiters(states, PATIENCE)
    assert published.launch_rank == 1 and Waiter.from_json(published.to_json()) == published
    assert Wait.from_json(None) is None


def test_the_cause_names_the_culprit_s_place_the_waiter_and_the_collective():
    cause = Blame(2, 3, TP1, 12, 11, 5.04, 6.2, "forward", 4).cause()
    assert cause.startswith("stuck: no progress for 5.0 s in phase forward of iteration 4 while launch rank 3 "
                            "has waited 6.2 s on it in group tp[0]:bbbb@0 (for collective 12; this rank entered 11")
