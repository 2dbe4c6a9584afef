"""Live failures with pipeline stages under NTP: PP2 × TP2 × 2 replicas (8 gloo ranks, 4 layers). A rank killed in
one stage re-forms that stage of its replica only: the other stage of the same replica keeps its objects (it
reports ``rebuilt: false``, the same model, DDP and optimizer), the other replica keeps everything, the loss is
the failure-free run's, every replica agrees with every other bit for bit after every iteration (per stage), and
the re-formation moved exactly what the stage's survivors lacked (``run_job`` checks it per stage).

Launch ranks in Megatron's order (TP fastest, then replica, then stage): stage 0 is launch ranks 0..3 (replica 0:
0, 1; replica 1: 2, 3), stage 1 is 4..7 (replica 0: 4, 5; replica 1: 6, 7). Each case kills two ranks, so the four
cases cover the first and the last stage in forward, backward, grad_sync and optimizer, and two of them degrade
both stages of one replica at once; two of them have tied embeddings (a failure in the last stage moves its copy
of them), the others untied; one more kills a rank and lets a replacement rejoin its stage.
"""

from __future__ import annotations

import pytest

from tests.harness import assert_groups_as_planned, assert_replicas_agree, run_job
from tests.jobs.live.test_live_failure import assert_same_run, launcher_lines, ntp_args

pytestmark = pytest.mark.job

ITERS = 6
PIPELINE = ("--set", "parallel.pipeline_model_parallel_size=2", "--set", "model.num_layers=4")
STAGE_OF = {rank: rank // 4 for rank in range(8)}
REPLICA_OF = {rank: rank % 4 // 2 for rank in range(8)}


def pipeline_args(extra: tuple[str, ...] = (), tied: bool = False) -> list[str]:
    untie = ("--set", f"model.untie_embeddings_and_output_weights={str(not tied).lower()}")
    return ntp_args(2, 2, iters=ITERS, extra=(*PIPELINE, *untie, *extra))


@pytest.fixture(scope="module")
def references(jobs):
    """The failure-free runs, untied and tied."""
    return {tied: jobs.run(f"pp-live-ref-{'tied' if tied else 'untied'}", pipeline_args(tied=tied))
            for tied in (False, True)}


@pytest.fixture(scope="module")
def reference_pp2(references):
    return references[False]


@pytest.mark.parametrize("kills, tied", [
    (("kill:rank=0,iter=2,phase=forward", "kill:rank=6,iter=4,phase=backward"), False),    # stage 0, then 1
    (("kill:rank=7,iter=2,phase=forward", "kill:rank=3,iter=4,phase=backward"), True),     # both of replica 1
    (("kill:rank=1,iter=2,phase=grad_sync", "kill:rank=4,iter=4,phase=optimizer"), True),  # both of replica 0
    (("kill:rank=5,iter=2,phase=grad_sync", "kill:rank=2,iter=4,phase=optimizer"), False),
], ids=["fwd0-bwd1", "fwd1-bwd0-tied", "sync0-opt1-tied", "sync1-opt0"])
def test_a_failure_in_a_stage_re_forms_that_stage_only(tmp_path, references, kills, tied):
    result = run_job(tmp_path / "run", pipeline_args(tuple(a for k in kills for a in ("--inject-failure", k)), tied))
    assert_same_run(result, references[tied], ITERS)
    assert_replicas_agree(result, ITERS)
    dead = [int(k.split("rank=")[1].split(",")[0]) for k in kills]
    failed = [e for e in result.records if e.get("event") == "rank_failed"]
    assert [(e["launch_rank"], e["stage"], e["replica"]) for e in failed] == \
        [(r, STAGE_OF[r], REPLICA_OF[r]) for r in dead], launcher_lines(result)
    # After each failure: exactly the dead rank's stage of its replica rebuilt; every other rank kept its objects.
    reports = [r for r in result.records if r.get("kind") == "reform_rank" and r["generation"] > 0]
    assert sorted({r["generation"] for r in reports}) == [1, 2], launcher_lines(result)
    for generation, killed in ((1, dead[:1]), (2, dead)):
        touched = {(STAGE_OF[r], REPLICA_OF[r]) for r in killed}
        changed = {(STAGE_OF[r], REPLICA_OF[r]) for r in killed[-1:]}
        for report in (r for r in reports if r["generation"] == generation):
            where = (report["stage"], report["replica"])
            assert report["launch_rank"] not in killed and where == (STAGE_OF[report["launch_rank"]],
                                                                     REPLICA_OF[report["launch_rank"]])
            kept = where not in changed
            assert report["rebuilt"] is not kept and report["same_model"] is kept, report
        widths = {(s, r): 2 - sum((STAGE_OF[k], REPLICA_OF[k]) == (s, r) for k in killed)
                  for s in range(2) for r in range(2)}
        assert all(widths[where] < 2 for where in touched)
        event = next(e for e in result.records if e.get("event") == "reformed" and e["generation"] == generation)
        assert event["tp_per_replica"] == [[widths[0, r], widths[1, r]] for r in range(2)], event
        assert event["moved_bytes"] == event["lower_bound_bytes"] > 0
    assert_groups_as_planned(result)


def test_a_replacement_rejoins_its_stage(tmp_path, reference_pp2):
    """Launch rank 6 (replica 1, slot 0, stage 1) is killed; a warm spare takes its place in stage 1 and the
    replica is back at TP2 in both stages, with the failure-free loss."""
    result = run_job(tmp_path / "run", pipeline_args((
        "--inject-failure", "kill:rank=6,iter=2,phase=backward", "--set", "ntp.rejoin_after_s=0",
        "--set", "ntp.warm_spares=1")))
    assert_same_run(result, reference_pp2, ITERS)
    assert_replicas_agree(result, ITERS)
    reformed = [e for e in result.records if e.get("event") == "reformed" and e["generation"] > 0]
    assert [e["tp_per_replica"] for e in reformed] == [[[2, 2], [2, 1]], [[2, 2], [2, 2]]], launcher_lines(result)
    assert reformed[-1]["joined"] == [[1, 0, 1]]
    assert all(e["moved_bytes"] == e["lower_bound_bytes"] > 0 for e in reformed)
    assert assert_groups_as_planned(result, healthy_tp_kept=True) == 8  # replica 0's 4 ranks, twice
