"""The soak's report over a recorded run (:mod:`ntp_megatron.bench.soak_report`): every failure the launcher's log
says it injected is absorbed, lost or pending; time degraded, losses against the failure-free run and resources per
generation are computed as written out here by hand."""

from __future__ import annotations

from ntp_megatron.bench import soak_report
from ntp_megatron.bench.soak_report import Sample

LOG = """\
ntp-launch: started ranks 0..3 of 4 (store 127.0.0.1:1, run dir /tmp/x)
ntp-launch: arming kill at phase forward in launch rank 3 (pid 103): random:mtbf=3,seed=3,kinds=kill+exit+slow
[rank 3]  injected failure: kill:rank=3,iter=2,phase=forward
ntp-launch: rank 3 (pid 103) was killed by signal SIGKILL
ntp-launch: injecting kill of launch rank 1 (pid 101) from outside: random:mtbf=3,seed=3,kinds=kill+exit+slow
ntp-launch: arming slow at phase start in launch rank 0 (pid 100) (factor 2.5 for 4 iterations): random:...
[rank 0]  injected slowdown: slow:rank=0,factor=2.5,iter=3 for 4 iterations
ntp-launch: arming exit at phase reform in launch rank 2 (pid 102): random:mtbf=3,seed=3,kinds=kill+exit+slow
ntp-launch: arming exit at phase start in launch rank 0 (pid 100): random:mtbf=3,seed=3,kinds=kill+exit+slow
[rank 0]  injected failure: exit:rank=0,iter=4,code=1
"""


def it(i: int, t: float, tp: list, loss: float, gen: int = 0) -> dict:
    return {"kind": "iteration", "iteration": i, "time": t, "tp_per_replica": tp, "lm_loss": loss, "generation": gen}


def event(name: str, t: float, **kw) -> dict:
    return {"kind": "event", "event": name, "time": t, **kw}


RECORDS = [
    event("generation_published", 0.0, generation=0),
    it(1, 1.0, [2, 2], 5.0),
    event("rank_failed", 1.5, launch_rank=3, cause="was killed by signal SIGKILL"),
    event("generation_published", 1.6, generation=1), event("reformed", 1.7, generation=1),
    it(2, 2.0, [2, 1], 4.0, 1),
    event("rank_failed", 2.5, launch_rank=1, cause="was killed by signal SIGKILL"),
    event("generation_published", 2.6, generation=2), event("reformed", 2.7, generation=2),
    it(3, 4.0, [1, 1], 3.0, 2),
    event("rank_failed", 4.5, launch_rank=0, cause="exited with code 1"),
    event("generation_published", 4.6, generation=3), event("reformed", 4.7, generation=3),
    it(4, 5.0, [2, 2], 2.0, 3),
    event("job_ended", 6.0, exit_code=0), event("job_summary", 6.0, goodput=0.5, wall_s=6.0),
]
REFERENCE = [it(1, 0, [2, 2], 5.0), it(2, 0, [2, 2], 4.0), it(3, 0, [2, 2], 3.00001), it(4, 0, [2, 2], 2.0)]


def test_every_injected_failure_is_accounted_for_by_kind():
    rep = soak_report.report(LOG, RECORDS, REFERENCE, [], exit_code=0, tp_base=2, train_iters=4, leftover=[])
    assert rep["by_kind"] == {
        "exit": {"injected": 2, "fired": 1, "absorbed": 1, "lost": 0, "pending": 1},  # the reform one never came
        "kill": {"injected": 2, "fired": 2, "absorbed": 2, "lost": 0, "pending": 0},
        "slow": {"injected": 1, "fired": 1, "absorbed": 1, "lost": 0, "pending": 0}}
    assert rep["failures"] == {"injected": 5, "fired": 4, "absorbed": 4, "lost": 0, "pending": 1}
    assert rep["deaths"] == 3 and rep["reformations"] == 3 and rep["generations"] == 3
    assert rep["unexplained_deaths"] == [] and rep["finished"]
    # Degraded from iteration 2's record to iteration 3's: (2.0 - 1.0) + (4.0 - 2.0) of 4.0 s.
    assert rep["time_degraded_s"] == 3.0 and rep["time_degraded_fraction"] == 0.75
    assert rep["goodput"] == 0.5


def test_a_death_the_job_did_not_survive_is_lost_and_an_unexplained_death_is_named():
    records = [r for r in RECORDS if not (r.get("event") == "reformed" and r["time"] > 4.0)]
    records = [r for r in records if r.get("iteration") != 4] + [
        event("rank_failed", 4.8, launch_rank=2, cause="exited with code 1")]
    rep = soak_report.report(LOG, records, REFERENCE, [], exit_code=1, tp_base=2, train_iters=4, leftover=[])
    assert rep["failures"]["lost"] == 2  # rank 0's exit (no re-formation after it) and the slowdown (run not done)
    assert {(x["kind"], x["rank"]) for x in rep["lost"]} == {("exit", 0), ("slow", 0)}
    assert [d["launch_rank"] for d in rep["unexplained_deaths"]] == [2]  # its armed exit never fired
    assert not rep["verdict"]["nothing_lost"] and rep["loss"]["missing"] == [4] and not rep["loss"]["equal"]


def test_losses_against_the_failure_free_run_use_the_kill_tests_tolerance():
    loss = soak_report.loss_against(soak_report.losses(RECORDS), soak_report.losses(REFERENCE))
    assert loss["iterations"] == 4 and loss["at_iteration"] == 3
    assert abs(loss["max_rel_delta"] - 0.00001 / 3.00001) < 1e-12 and loss["equal"]  # 3.3e-6 <= 1e-5
    worse = soak_report.loss_against({**soak_report.losses(RECORDS), 2: 4.001}, soak_report.losses(REFERENCE))
    assert not worse["equal"] and worse["at_iteration"] == 2
    nan = soak_report.loss_against({**soak_report.losses(RECORDS), 1: float("nan")}, soak_report.losses(REFERENCE))
    assert not nan["equal"] and nan["max_rel_delta"] == float("inf")
    assert soak_report.LOSS_TOL == 1e-5


def test_resources_per_generation_first_last_max_and_growth():
    samples = [Sample(0.5, 10, "launcher", 100.0, 5, 20), Sample(5.5, 10, "launcher", 110.0, 5, 20),
               Sample(0.5, 100, "rank 0", 300.0, 15, 34), Sample(2.0, 100, "rank 0", 320.0, 18, 40),
               Sample(3.0, 100, "rank 0", 310.0, 15, 34), Sample(0.5, 101, "rank 1", 302.0, 15, 34),
               Sample(5.0, 200, "rank 1", 290.0, 15, 34), Sample(1.0, 7, "other", 50.0, 2, 5),
               Sample(2.2, 100, "rank 0", 305.0, 16, 38),  # generation 1 again: its least counts are its steady ones
               Sample(6.5, 10, "launcher", 90.0, 1, 3)]  # after the job ended: shutdown, left out
    rows = {r.what: r for r in soak_report.resources(samples, RECORDS)}
    assert rows["launcher"].first == {"rss_mb": 100.0, "threads": 5, "fds": 20}
    assert rows["launcher"].growth == {"rss_mb": 10.0, "threads": 0, "fds": 0}
    ranks = rows["ranks"]
    assert ranks.processes == 3 and ranks.first == {"rss_mb": 301.0, "threads": 15, "fds": 34}
    assert ranks.last == {"rss_mb": 290.0, "threads": 15, "fds": 34}  # generation 3: the replacement only
    assert ranks.max == {"rss_mb": 320.0, "threads": 18, "fds": 40}
    assert soak_report._grouped(samples, RECORDS)["rank 0", 100][1].threads == 16
    # rank 0's process: generation 0 (300, 15, 34) to generation 2 (310, 15, 34): no thread or fd left behind.
    assert ranks.growth == {"rss_mb": 10.0, "threads": 0, "fds": 0}
    rep = soak_report.report(LOG, RECORDS, REFERENCE, samples, 0, 2, 4, leftover=[])
    assert rep["verdict"] == {"nothing_lost": True, "nothing_leaked": True, "grew": {}, "loss_equal": True}
    assert "| kill | 2 | 2 | 2 | 0 | 0 |" in soak_report.table(rep)
    leaked = soak_report.report(LOG, RECORDS, REFERENCE, samples, 0, 2, 4, leftover=[4242])
    assert not leaked["verdict"]["nothing_leaked"] and "4242" in soak_report.table(leaked)


def resources(rank: int, gen: int, threads: int, fds: int, held: int = 0) -> dict:
    return {"kind": "resources", "launch_rank": rank, "generation": gen, "threads": threads, "fds": fds,
            "rss_mb": 300.0 + gen, "held_generations": held}


def test_rank_growth_per_process_is_the_floor_of_its_last_generations_against_its_first():
    records = [event("generation_published", float(g), generation=g) for g in range(10)]
    records += [resources(0, g, 15 + (g == 4) * 3, 32) for g in range(9)]  # a helper thread once: no growth
    records += [resources(1, g, 15, 32 + g // 3) for g in range(4)]  # fds 32 32 32 33: floor 32 -> 33
    records += [event("replacement_started", 4.5, launch_rank=1)]  # launch rank 1's new process from generation 5
    records += [resources(1, g, 15, 30) for g in range(5, 9)]
    procs = soak_report.rank_processes(records)
    assert sorted(procs) == [(0, 0), (1, 0), (1, 5)] and len(procs[1, 5]) == 4
    growth = soak_report.rank_growth(records)
    assert (growth["threads"], growth["fds"], growth["grew"], growth["processes"]) == (0, 1, 1, 3)
    assert growth["fds_where"] == "launch rank 1 from generation 0" and growth["rss_mb"] == 6.0
    rep = soak_report.report("", records + [it(1, 1.0, [2], 1.0)], [it(1, 0, [2], 1.0)], [], 0, 2, 1, [])
    assert rep["verdict"]["grew"] == {"fds": 1} and not rep["verdict"]["nothing_leaked"]
