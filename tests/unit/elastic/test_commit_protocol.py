"""The exactly-once commit protocol (:mod:`ntp_megatron.elastic.commit`) against the controller that aborts, in
one process on an in-memory store: every order of the last vote against the controller's abort, a voter killed
at each of its store operations, what a survivor reads after the next generation is published, and the waits.

Rules under test (the module docstring of :mod:`ntp_megatron.elastic.commit`): one decision per iteration,
first writer wins; every rank reads the same one; a rank steps only on ``commit``; the controller settles the
first iteration that is not committed; a generation marked over without a decision counts as the controller's
verdict; every wait is bounded by the store's timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional

import pytest
import torch.distributed as dist

from ntp_megatron.elastic import commit, keys, publication
from ntp_megatron.elastic.commit import ABORT, COMMIT, COMMIT_REFORM, CommitProtocol, settle
from ntp_megatron.elastic.reform import settle_voted
from tests.unit.elastic.elastic_job import Job, admission_pending, death, voter
from tests.unit.elastic.interleavings import Interleaving, Killed, every_order, hash_store


def _shared(generation: int, iteration: int):
    """The keys the last voter of ``iteration`` and the controller both touch: the iteration's decision, the
    committed iteration, the generation's end (what else they touch, only one of them does)."""
    return {commit.decision_key(generation, iteration), commit.COMMITTED, keys.abort(generation)}.__contains__


def _every_key(key: str) -> bool:
    return True


# -- the last vote against the controller's abort ----------------------------------------------------------------

def _vote_race(tp: int, dp: int, start: int, seen: list):
    """The trial: a rank that voted for iteration k dies and the controller handles it, racing the last voter.
    Checks the rules and appends to ``seen`` what each actor observed and what was decided."""
    world, k = tp * dp, start + 2
    dead, last = world - 1, world - 2

    def trial(il: Interleaving) -> None:
        job = Job(il.store, tp, dp, start=start, controller_store=il.proxy("controller"))
        job.form(0)
        job.commit(0, k - 1)
        early = [voter(job.protocol(0), k) for _ in range(last)]
        il.store.add(commit.votes_key(0, k), 1)  # the rank that dies voted first
        job.alive.discard(dead)
        job.notice(0)
        results = il.run({"controller": lambda: job.controller.handle([death(dead)]),
                          "voter": lambda: job.protocol(0, il.proxy("voter")).vote(k)})
        job.controller.close()
        decisions = [v.outcome() for v in early] + [results["voter"]]
        assert results["controller"] is None, job.said
        assert len(set(decisions)) == 1 and decisions[0] in (COMMIT, ABORT), (decisions, il.trace)
        decided = decisions[0]
        assert job.latest() == 1
        assert job.protocol(0).decision(k) == decided, il.trace  # what a survivor reads after generation 1 came
        first_open = k + 1 if decided == COMMIT else k
        settled = {"generation": 0, "iteration": first_open, "decision": ABORT, "started": 0}
        assert job.controller.settled == settled, il.trace
        assert job.info(1)["settled"] == settled
        assert job.committed() == first_open - 1, il.trace
        seen.append((decided, tuple(il.seen["voter"]), tuple(il.seen["controller"])))

    return trial, _shared(0, k)


@pytest.mark.parametrize("tp, dp, start", [(1, 2, 0), (1, 3, 0), (2, 2, 0), (3, 2, 0), (2, 2, 7)],
                         ids=["2", "3", "4", "6", "4-resumed"])
def test_last_vote_against_the_abort_in_every_order(tp, dp, start):
    """A rank that voted for iteration k dies; the last voter's ``commit`` races the controller's ``abort``. In
    every order of their store operations (world sizes 2 to 6, a fresh and a resumed run): every rank has the
    same decision, the store holds it, a survivor reading it after the next generation was published finds it
    too (rolls forward or drops alike), and the controller settled the first iteration not committed, published
    as such."""
    seen: list = []
    orders = every_order(*_vote_race(tp, dp, start, seen))
    assert {decided for decided, _, _ in seen} == {COMMIT, ABORT}
    assert len(orders) >= 5, len(orders)


def test_the_reduced_search_observes_all_that_every_order_does():
    """The vote race run in every order of the watched operations, equivalent or not: each actor observes
    nothing there that the reduced search did not show it."""
    reduced: list = []
    every_order(*_vote_race(1, 2, 0, reduced))
    full: list = []
    runs = every_order(*_vote_race(1, 2, 0, full), reduce=False)
    assert set(full) == set(reduced)
    assert len(runs) > 5 * len(set(reduced)), (len(runs), len(set(reduced)))


@pytest.mark.parametrize("tp, dp", [(2, 2), (3, 2)])
def test_last_vote_against_the_abort_at_an_admission_boundary(tp, dp):
    """The same race when the controller had asked for an admission: the last voter writes ``commit+reform``. If it
    wins, the generation ended at that boundary and the controller settles nothing; if the abort wins, the
    iteration is redone and nobody moves."""
    world = tp * dp
    replacement, dead = world - 1, 0
    outcomes = set()

    def trial(il: Interleaving) -> None:
        job = Job(il.store, tp, dp, controller_store=il.proxy("controller"))
        admission_pending(job, replacement)
        members = job.members(1)
        k = 3
        early = [voter(job.protocol(1), k) for _ in members[2:]]
        il.store.add(commit.votes_key(1, k), 1)  # launch rank 0 votes, then dies
        job.alive.discard(dead)
        job.notice(1)
        job.notice(2)
        results = il.run({"controller": lambda: job.controller.handle([death(dead)]),
                          "voter": lambda: job.protocol(1, il.proxy("voter")).vote(k)})
        job.controller.close()
        decisions = [v.outcome() for v in early] + [results["voter"]]
        assert len(set(decisions)) == 1 and decisions[0] in (COMMIT_REFORM, ABORT), (decisions, il.trace)
        decided = decisions[0]
        outcomes.add(decided)
        info = job.info(3)
        assert info["base"] == 1, "generation 2 (the admission) never formed"
        if decided == COMMIT_REFORM:
            assert info["settled"] is None, il.trace
            assert job.committed() == k
        else:
            assert info["settled"] == {"generation": 1, "iteration": k, "decision": ABORT, "started": 0}, il.trace
            assert job.committed() == k - 1
        assert il.store.get(commit.formed_key(2)).decode() == "incomplete"

    every_order(trial, _shared(1, 3))
    assert outcomes == {COMMIT_REFORM, ABORT}


# -- the last voter killed at each of its operations -------------------------------------------------------------

VOTE_OPERATIONS = ["add votes", "check reform_requested", "compare_set decision", "set committed", "wait decision",
                   "get decision", "(none: it returned)"]


@pytest.mark.parametrize("at", range(len(VOTE_OPERATIONS)), ids=VOTE_OPERATIONS)
def test_last_voter_killed_before_each_of_its_operations(at):
    """The last voter of iteration k dies just before one of its store operations; the controller handles its
    death, generation 1 forms, and a second rank dies before generation 1 commits anything. Both times the
    controller settles the first iteration not committed (so generation 1's voters, who vote for it, are told at
    once), every survivor has the same decision on k, and the committed iteration a fresh process would resume
    after is right."""
    store = hash_store()
    job = Job(store, 1, 3)
    job.form(0)
    job.commit(0, 1)
    k, last = 2, 2
    early = [voter(job.protocol(0), k) for _ in range(last)]
    il = Interleaving(store, _every_key, kill={"voter": at})
    result = il.run({"voter": lambda: job.protocol(0, il.proxy("voter")).vote(k)})["voter"]
    assert isinstance(result, Killed) == (at < len(VOTE_OPERATIONS) - 1), result
    done = [f"{op} {key.rsplit('/', 1)[-1]}" for _, op, key in il.trace]
    assert done == VOTE_OPERATIONS[:min(at + 1, len(VOTE_OPERATIONS) - 1)], "the vote's operations changed"
    assert job.die(last) is None
    decisions = {v.outcome() for v in early}
    committed = at > VOTE_OPERATIONS.index("compare_set decision")
    assert decisions == {COMMIT if committed else ABORT}
    first_open = k + 1 if committed else k
    assert job.info(1)["settled"]["iteration"] == first_open
    assert job.committed() == first_open - 1, "a fresh process would resume after an iteration not yet committed"

    assert job.form(1) == ["complete"] * 2
    late = voter(job.protocol(1), first_open)  # launch rank 0 votes for the iteration it is at, then 1 dies
    assert job.die(1) is None
    assert job.info(2)["settled"] == {"generation": 1, "iteration": first_open, "decision": ABORT, "started": 0}
    assert late.outcome() == ABORT


# -- what a survivor reads after the next generation was published -----------------------------------------------

def test_a_rank_that_voted_rolls_forward_when_its_iteration_committed():
    """Every rank voted for k and the last vote committed it; a rank dies before stepping. After the controller
    published generation 1, a survivor that had voted but not stepped reads ``commit`` (it steps k, then trains
    k + 1): the controller settled k + 1, not k."""
    store = hash_store()
    job = Job(store, 1, 3)
    job.form(0)
    assert job.commit(0, 1) == [COMMIT] * 3
    assert job.die(2) is None
    assert job.latest() == 1
    assert job.protocol(0).decision(1) == COMMIT
    assert job.info(1)["settled"]["iteration"] == 2


class _Voted:
    """A rank's training state as the re-formation sees it: it voted for ``iteration`` and has not stepped."""

    def __init__(self, iteration: int) -> None:
        self.pending: Optional[int] = iteration
        self.stepped: list[int] = []

    def pending_iteration(self) -> Optional[int]:
        return self.pending

    def settle(self, committed: bool) -> None:
        if committed:
            self.stepped.append(self.pending)
        self.pending = None


def test_a_survivor_steps_the_committed_iteration_it_voted_for_and_drops_an_aborted_one():
    """The re-forming rank's side (``reform.settle_voted``) over the real protocol: it reads the decision only
    once the next generation is published, steps iteration 1 (committed before the death) and drops iteration 2
    (aborted by the controller)."""
    store = hash_store()
    job = Job(store, 1, 3)
    job.form(0)
    job.commit(0, 1)
    voted_2 = [voter(job.protocol(0), 2) for _ in range(2)]  # rank 2 dies before its vote: 2 never commits
    published: list[int] = []
    assert job.die(2) is None
    rolled, dropped = _Voted(1), _Voted(2)
    settle_voted(rolled, job.protocol(0), lambda: published.append(job.latest()))
    settle_voted(dropped, job.protocol(0), lambda: published.append(job.latest()))
    assert rolled.stepped == [1] and dropped.stepped == [] and dropped.pending is None
    assert published == [1, 1]
    assert [v.outcome() for v in voted_2] == [ABORT, ABORT]


def test_a_rank_that_voted_drops_its_iteration_when_it_was_aborted():
    """A rank dies before voting for k: the others' votes never complete the count. Before the controller acts
    there is no decision yet (a survivor must wait for the next generation before reading it); after, every voter
    and every reader finds ``abort`` and k is redone."""
    store = hash_store()
    job = Job(store, 1, 3)
    job.form(0)
    job.commit(0, 1)
    voters = [voter(job.protocol(0), 2) for _ in range(2)]
    assert job.protocol(0).decision(2) is None
    assert job.die(2) is None
    assert [v.outcome() for v in voters] == [ABORT, ABORT]
    assert job.protocol(0).decision(2) == ABORT
    assert job.info(1)["settled"] == {"generation": 0, "iteration": 2, "decision": ABORT, "started": 0}
    assert job.committed() == 1


def test_settle_skips_every_committed_iteration_and_stops_at_an_admission_boundary():
    """``settle`` directly: committed iterations are never aborted, the first open one is; a generation that ended
    with ``commit+reform`` has nothing in flight."""
    store = hash_store()
    job = Job(store, 1, 2)
    job.form(0)
    for k in (1, 2):
        job.commit(0, k)
    assert settle(store, 0) == (3, ABORT, 0)
    assert settle(store, 0) == (3, ABORT, 0), "settling again decides nothing new"
    assert job.protocol(0).decision(2) == COMMIT

    store = hash_store()
    job = Job(store, 1, 2)
    job.form(0)
    job.commit(0, 1)
    store.set(publication.reform_requested_key(0), "1")
    assert job.commit(0, 2) == [COMMIT_REFORM] * 2
    assert settle(store, 0) is None
    assert not store.check([commit.decision_key(0, 3)])


# -- the waits ---------------------------------------------------------------------------------------------------

def test_a_generation_marked_over_without_a_decision_counts_as_abort():
    """Nobody will decide (the generation was marked over without it): the voter's wait ends with the store's
    timeout, and that counts as ``abort``; a rank forming that generation reads ``incomplete``."""
    store = hash_store(0.1)
    protocol = CommitProtocol(store, 0, 2)
    store.set(keys.abort(0), "stop")
    started = time.monotonic()
    assert protocol.vote(1) == ABORT
    assert protocol.form() == "incomplete"
    assert time.monotonic() - started < 2.0


def test_a_decision_that_came_as_the_wait_timed_out_stands():
    """A voter's wait times out just as the last vote commits, and a failure then marks the generation over: the
    voter reads ``commit`` like everyone else, not ``abort`` (it would skip a step the others took)."""
    store = hash_store()
    job = Job(store, 1, 3)
    job.form(0)

    class LateDecision:
        def __getattr__(self, name):
            return getattr(store, name)

        def wait(self, keys_):
            try:
                store.wait(keys_, timedelta(seconds=0.1))  # nobody else voted yet: this wait times out
            except dist.DistStoreError:
                voter(job.protocol(0), 1)  # the other two votes come in, the last one commits
                assert job.protocol(0).vote(1) == COMMIT
                job.die(2)  # then a rank dies
                raise

    assert job.protocol(0, LateDecision()).vote(1) == COMMIT
    assert job.info(1)["settled"]["iteration"] == 2


def test_every_wait_is_bounded_by_the_store_timeout():
    """A vote or a formation nobody completes and nobody ends raises ``TimeoutError`` after the store's
    timeout: nothing hangs."""
    store = hash_store(0.1)
    protocol = CommitProtocol(store, 0, 2)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no decision"):
        protocol.vote(1)
    with pytest.raises(TimeoutError, match="no decision"):
        protocol.form()
    assert time.monotonic() - started < 2.0
