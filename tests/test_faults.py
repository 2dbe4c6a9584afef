"""--inject-failure specs: parsing, validation, and the round trip to the ranks."""

from __future__ import annotations

import pytest

from ntp_megatron.config_io import ConfigError
from ntp_megatron.faults import FailureSpec, FailureTrigger, from_env, parse_failure_spec, to_env, ENV_FAILURES


def test_parse_and_round_trip():
    specs = [parse_failure_spec("kill:rank=1,iter=5"), parse_failure_spec("exit:rank=3,iter=2,code=9", 4)]
    assert specs == [FailureSpec("kill", 1, 5), FailureSpec("exit", 3, 2, 9)]
    assert [str(s) for s in specs] == ["kill:rank=1,iter=5", "exit:rank=3,iter=2,code=9"]
    assert from_env({ENV_FAILURES: to_env(specs)}) == specs
    assert from_env({}) == []


@pytest.mark.parametrize(
    "text, fragment",
    [("boom:rank=1,iter=2", "ACTION in kill, exit"), ("kill:rank=1", "missing iter"),
     ("kill:rank=x,iter=2", "rank must be an integer"), ("kill:rank=4,iter=2", "rank must be in 0..3"),
     ("kill:rank=1,iter=0", "iter must be ≥ 1"), ("kill:rank=1,iter=2,code=3", "code applies to the exit"),
     ("kill:rank=1,iter=2,when=now", "unknown field 'when'")],
)
def test_bad_specs_say_what_is_allowed(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_failure_spec(text, world_size=4)


def test_trigger_fires_only_in_its_rank_and_iteration(monkeypatch):
    exits = []
    monkeypatch.setattr("os._exit", lambda code: exits.append(code))
    trigger = FailureTrigger(rank=2, specs=[FailureSpec("exit", 2, 3, 7), FailureSpec("exit", 1, 3, 5)])
    for it in (1, 2, 3, 3, 4):
        trigger.before_iteration(it)
    assert exits == [7]
