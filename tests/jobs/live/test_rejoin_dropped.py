"""A dropped replica comes back: replica 1 of TP2 x 2 starts with one live slot (slot 1 dead), loses it (so it is
dropped and its share of every global batch goes to replica 0), and the failed rank's replacement rebuilds it alone
at TP1, holding both canonical blocks. Every unit of the replica and the replicated parameters must move to it,
once, and the loss curve is the failure-free run's."""

from __future__ import annotations

from tests.harness import assert_groups_as_planned, assert_replicas_agree, run_job
from tests.jobs.live.test_live_failure import assert_same_run, ntp_args, widths_by_iteration

ITERS = 30  # a warm spare replaces the failed rank: it does not wait for an interpreter to boot (a cold replacement is
# tests/jobs/live/test_healthy_replicas.py's)


def test_a_dropped_replica_is_rebuilt_by_one_replacement(tmp_path, jobs):
    dead = ("--set", "ntp.dead_slots=[1:1]")
    # The failure-free run: every topology trains the same model, so it is the healthy TP2 x 2 one of
    # tests/jobs/live/test_rejoin.py (the same arguments: the session runs it once), as the live-failure tests' runs
    # compare with theirs.
    reference = jobs.run("rejoin-ref", ntp_args(2, 2, iters=ITERS))
    args = ntp_args(2, 2, iters=ITERS, extra=(*dead, "--set", "ntp.rejoin_after_s=0", "--set", "ntp.warm_spares=1"))
    result = run_job(tmp_path / "run", [*args, "--inject-failure", "kill:rank=2,iter=4,phase=backward"], timeout=400)
    assert_same_run(result, reference, ITERS)
    assert_replicas_agree(result, ITERS)
    widths = widths_by_iteration(result)
    assert widths[3] == [2, 1] and widths[4] == [2, 0] and widths[ITERS] == [2, 1], widths  # 4 redone, dropped
    reformed = result.events("reformed")
    assert reformed[-1]["joined"] == [[1, 0]] and reformed[-1]["tp_per_replica"] == [2, 1]
    assert assert_groups_as_planned(result, healthy_tp_kept=True) == 2 * len(reformed)
