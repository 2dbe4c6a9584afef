"""Repaired ranks rejoin live: a replacement process for a failed rank is started, boots while the job trains
degraded, is admitted at an iteration boundary and takes its canonical block back; one that dies while being
admitted leaves the job degraded, and the next attempt succeeds. The loss curve is the failure-free run's.

The first replacement hangs inside the rendezvous of the generation that admits it (``hang:...,phase=connect``,
SIGSTOP): it arrives first, publishes its address and stops while it waits for the others, who then connect to it;
those that listen for its connection (gloo lets the side with the larger address connect: each survivor with
probability 1/2) wait until the launcher has fenced it and beyond, 5 x the group's timeout, unless the connect is given
up with its generation (``patches/torch_distributed_c10d.py``); ``timing.stopped_grace_s`` gives the survivors the time
to reach the rendezvous (they finish an iteration first) before the hung replacement is fenced. The second dies after
it joined, as it re-forms (``phase=reform``)."""

from __future__ import annotations

from tests.harness import assert_groups_as_planned, run_job
from tests.jobs.live.test_live_failure import assert_replicas_agree, assert_same_run, ntp_args, widths_by_iteration

ITERS = 30  # three warm spares take the three attempts: none waits for an interpreter to boot (a cold replacement
# rejoins in tests/jobs/live/test_rejoin_dropped.py)


def test_failed_rank_rejoins_after_a_failed_admission(tmp_path, jobs):
    reference = jobs.run("rejoin-ref", ntp_args(2, 2, iters=ITERS))
    args = ntp_args(2, 2, iters=ITERS, extra=("--set", "ntp.rejoin_after_s=0", "--set", "ntp.max_rejoin_attempts=3",
                                                 "--set", "ntp.warm_spares=3", "--set", "timing.stopped_grace_s=3"))
    args += ["--inject-failure", "kill:rank=3,iter=5,phase=backward",   # the failure
             "--inject-failure", "hang:rank=3,iter=5,phase=connect",    # the first replacement hangs in the rendezvous
             "--inject-failure", "kill:rank=3,iter=6,phase=reform"]     # the second dies re-forming
    result = run_job(tmp_path / "run", args, timeout=400)
    assert_same_run(result, reference, ITERS)  # run_job fails a re-formation that takes half of parallel.timeout_s
    assert_replicas_agree(result, ITERS)
    started = result.events("replacement_started")
    assert [e["attempt"] for e in started] == [1, 2, 3] and all(e["launch_rank"] == 3 for e in started)
    failed = result.events("rank_failed")
    assert [(e["launch_rank"], e["phase"]) for e in failed] == [(3, "backward"), (3, "connect"), (3, "reform")]
    reformed = result.events("reformed")
    # Degraded, back to the same degraded layout after each failed admission, then full width.
    assert [e["tp_per_replica"] for e in reformed] == [[2, 1], [2, 1], [2, 1], [2, 2]]
    assert reformed[-1]["joined"] == [[1, 1]]
    assert reformed[-1]["moved_bytes"] == reformed[-1]["lower_bound_bytes"] > 0
    widths = widths_by_iteration(result)
    assert widths[4] == [2, 2] and widths[6] == [2, 1] and widths[ITERS] == [2, 2]
    rejoined_at = reformed[-1]["resume_iteration"]
    assert all(widths[i] == [2, 2] for i in range(rejoined_at, ITERS + 1))
    # Not healthy_tp_kept: a rendezvous cut short may leave replica 0's TP group half-matched (one of its ranks got
    # past the connect and drained the group, the other did not), and its members' verdict makes it anew.
    assert_groups_as_planned(result)
