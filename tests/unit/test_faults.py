"""--inject-failure: the grammar (in-rank and controller-side forms), its one-line errors, the round trip to the
ranks, the in-rank trigger, and the random schedule."""

from __future__ import annotations

import re

import pytest

from ntp_megatron.config.files import ConfigError
from ntp_megatron.faults import (ENV_FAILURES, RandomFailures, RankFailure, TimedKill, FailureTrigger, from_env,
                                 parse_failure_spec, to_env)


def test_parse_every_form_and_round_trip():
    specs = [parse_failure_spec("kill:rank=1,iter=5"), parse_failure_spec("exit:rank=3,iter=2,code=9", 4),
             parse_failure_spec("hang:rank=0,iter=3,phase=backward", 4, 10),
             parse_failure_spec("kill:rank=2,iter=4,phase=optimizer"),
             parse_failure_spec("kill:rank=2,iter=4,phase=param_gather", 4, 10),
             parse_failure_spec("kill:rank=1,iter=2,phase=checkpoint", checkpoints=True),
             parse_failure_spec("kill:rank=3,after=7.5", 4), parse_failure_spec("random:mtbf=30"),
             parse_failure_spec("random:mtbf=5,seed=3,max=2,action=hang")]
    assert specs == [RankFailure("kill", 1, 5), RankFailure("exit", 3, 2, code=9),
                     RankFailure("hang", 0, 3, "backward"), RankFailure("kill", 2, 4, "optimizer"),
                     RankFailure("kill", 2, 4, "param_gather"), RankFailure("kill", 1, 2, "checkpoint"), TimedKill(3, 7.5), RandomFailures(30.0),
                     RandomFailures(5.0, seed=3, max=2, action="hang")]
    assert [str(s) for s in specs[:3]] == ["kill:rank=1,iter=5", "exit:rank=3,iter=2,code=9",
                                           "hang:rank=0,iter=3,phase=backward"]
    # The ranks get the in-rank specs only; the launcher keeps the rest.
    assert from_env({ENV_FAILURES: to_env(specs)}) == [s for s in specs if isinstance(s, RankFailure)]
    assert from_env({}) == []


@pytest.mark.parametrize(
    "text, fragment",
    [("boom:rank=1,iter=2", "ACTION in kill, hang, exit"), ("kill:rank=1", "missing iter"),
     ("kill:rank=x,iter=2", "rank must be an integer"), ("kill:rank=4,iter=2", "rank must be a launch rank in 0..3"),
     ("kill:rank=1,iter=0", "iter must be ≥ 1"), ("kill:rank=1,iter=2,code=3", "code applies to the exit"),
     ("kill:rank=1,iter=2,when=now", "unknown field 'when'"), ("kill:rank=1,iter=2,phase=lunch", "phase must be one of"),
     ("kill:rank=1,iter=11", "iter 11 is past training.train_iters (10)"),
     ("kill:rank=1,iter=3,phase=checkpoint", "phase checkpoint needs checkpoints"),
     ("kill:rank=1,iter=2,rank=2", "field 'rank' given twice"), ("exit:rank=1,after=3", "after= applies to kill only"),
     ("kill:rank=1,after=-1", "after must be ≥ 0"), ("random:seed=1", "missing mtbf"),
     ("random:mtbf=0", "mtbf must be > 0"), ("random:mtbf=3,action=exit", "action must be kill or hang"),
     ("random:mtbf=3,max=0", "max must be ≥ 1")],
)
def test_bad_specs_say_what_is_wrong(text, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
        parse_failure_spec(text, world_size=4, train_iters=10)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("phase", ["reform", "connect"])
def test_formation_phases_need_ntp(phase):
    parse_failure_spec(f"kill:rank=1,iter=2,phase={phase}", ntp=True)
    with pytest.raises(ConfigError, match=f"phase {phase} needs ntp.enabled"):
        parse_failure_spec(f"kill:rank=1,iter=2,phase={phase}", ntp=False)


def test_formation_phases_fire_in_the_first_formation_at_their_iteration_or_later(monkeypatch):
    exits = []
    monkeypatch.setattr("os._exit", lambda code: exits.append(code))
    trigger = FailureTrigger(launch_rank=3, specs=[RankFailure("exit", 3, 5, "connect", 9)])
    for iteration in (1, 4):
        trigger.point("connect", iteration)
    assert exits == []  # a process that starts at iteration 1 does not die in its first rendezvous
    trigger.point("connect", 7)  # a replacement's first, later in the run
    trigger.point("connect", 8)
    assert exits == [9]


@pytest.mark.parametrize("phase", ["checkpoint", "checkpoint_write"])
def test_checkpoint_phases_need_checkpoints_to_be_saved(phase):
    parse_failure_spec(f"error:rank=1,iter=2,phase={phase}", checkpoints=True)
    with pytest.raises(ConfigError, match=f"phase {phase} needs checkpoints to be saved"):
        parse_failure_spec(f"error:rank=1,iter=2,phase={phase}", checkpoints=False)


def test_trigger_fires_once_in_its_rank_iteration_and_phase(monkeypatch):
    exits, fired_log = [], []
    monkeypatch.setattr("os._exit", lambda code: exits.append(code))
    already = {str(RankFailure("exit", 2, 4, code=5))}
    trigger = FailureTrigger(
        launch_rank=2,
        specs=[RankFailure("exit", 2, 3, "backward", 7), RankFailure("exit", 1, 3, code=6),
               RankFailure("exit", 2, 4, code=5)],
        on_fire=fired_log.append, fired=lambda spec: str(spec) in already)
    for iteration in (1, 2, 3, 4, 5):
        trigger.iteration = iteration
        for phase in ("start", "forward", "backward", "grad_sync", "optimizer"):
            trigger.point(phase)
            trigger.point(phase)
    assert exits == [7]  # the other rank's spec never fires here; the one that already fired (a restart) neither
    assert fired_log == [RankFailure("exit", 2, 3, "backward", 7)]


def test_random_schedule_is_seeded_and_bounded():
    times = [t for t, _ in RandomFailures(10.0, seed=4, max=5).schedule()]
    assert len(times) == 5 and times == sorted(times)
    assert times == [t for t, _ in RandomFailures(10.0, seed=4, max=5).schedule()]
    assert times != [t for t, _ in RandomFailures(10.0, seed=5, max=5).schedule()]
