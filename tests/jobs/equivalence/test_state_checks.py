"""Every live (replica, TP rank) reports its state checksums at every iteration, across failures: a failure that
cut a rank's check short (the check of iteration k runs after k's step, and a death anywhere ends every
collective of the generation) is made up in the generation that follows. Which ranks must have reported is worked
out from what the job published (``tests.harness.assert_replicas_agree``), not from the ranks' reports."""

from __future__ import annotations

import pytest

from ntp_megatron.plan.layout import Topology
from tests.harness import JobResult, assert_replicas_agree
from tests.jobs.live.test_live_failure import assert_same_run, kill_during_a_reformation, kill_in_phase, ntp_args


def published(result: JobResult) -> dict[int, tuple[Topology, list]]:
    """Generation -> (its topology, the slots it admitted)."""
    return {e["generation"]: (Topology.from_json(e["topology"]), [tuple(s) for s in e["joined"]])
            for e in result.events("generation_published")}


@pytest.mark.parametrize("phase", ["start", "optimizer"])
def test_checksums_from_every_rank_at_every_iteration(jobs, phase):
    """``optimizer``: rank 3 dies after voting for iteration 5, so its TP peer's check of 5 (a gather with it)
    always fails in generation 0. ``start``: rank 3 dies as iteration 5 begins, while the ranks of the other
    replica may still be checking iteration 4."""
    reference = jobs.run("live-ref-tp2x2", ntp_args(2, 2))
    result = kill_in_phase(jobs, phase)  # the job of test_live_failure.test_kill_in_each_phase, run once
    assert_same_run(result, reference)
    assert_replicas_agree(result)  # the checks made up in generation 1 agree with those of generation 0


def test_checksums_after_a_second_failure_in_the_re_formation(jobs):
    """Rank 2 dies in the re-formation after rank 7's death: the checks are made up in generation 2."""
    reference = jobs.run("live-ref-tp4x2", ntp_args(4, 2))
    result = kill_during_a_reformation(jobs)  # test_live_failure.test_kill_while_a_reformation_is_in_progress's
    assert_same_run(result, reference)
    assert_replicas_agree(result)
