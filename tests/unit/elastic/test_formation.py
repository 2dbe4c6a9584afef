"""A formation's strategy (:mod:`ntp_megatron.elastic.formation`): chosen once from what the generation needs, and
the schedule each gives rebuilt objects when they are adopted — the same as the flags ``fresh`` and ``loaded`` gave
before the strategies (the rule written out below)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import pytest

from ntp_megatron.elastic.formation import LoadedStart, OwnStart, Progress, ShardMoves, Strategy, UnitMoves, choose


def _cfg(load: Optional[str], distributed: bool) -> SimpleNamespace:
    return SimpleNamespace(checkpoint=SimpleNamespace(load=load),
                           parallel=SimpleNamespace(use_distributed_optimizer=distributed))


@pytest.mark.parametrize("fresh, load, distributed, chosen", [
    (True, None, False, OwnStart), (True, None, True, OwnStart),
    (True, "/ckpt", False, LoadedStart), (True, "/ckpt", True, LoadedStart),
    (False, None, False, UnitMoves), (False, "/ckpt", False, UnitMoves),
    (False, None, True, ShardMoves), (False, "/ckpt", True, ShardMoves),
])
def test_choose(fresh, load, distributed, chosen):
    strategy = choose(_cfg(load, distributed), fresh, None, ("exp_avg", "exp_avg_sq"))
    assert type(strategy) is chosen
    assert strategy.fresh == fresh
    assert strategy.keeps == (not (fresh and load is not None))  # a loaded start rebuilds every rank


class _Scheduler:
    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []

    def state_dict(self) -> dict:
        return {"from": self.name}

    def load_state_dict(self, state: dict) -> None:
        self.calls.append(("load", state["from"]))

    def step(self, increment: int) -> None:
        self.calls.append(("step", increment))


def _before(fresh: bool, loaded: bool, has_old: bool, progress: Optional[Progress]) -> list:
    """What ``Reformer._adopt`` did with rebuilt objects' schedule from the flags, before the strategies."""
    if has_old:
        return [] if loaded else [("load", "old")]
    return [("step", progress.scheduler_steps)] if progress is not None and not loaded else []


@pytest.mark.parametrize("strategy", [OwnStart(), LoadedStart(), UnitMoves(None, ()), ShardMoves()],
                         ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("has_old", [True, False])
def test_schedule_of_rebuilt_objects(strategy: Strategy, has_old: bool):
    progress = None if strategy.fresh else Progress(adam_step=7, scheduler_steps=56)  # as Formation.run takes it
    new = SimpleNamespace(scheduler=_Scheduler("new"))
    old = SimpleNamespace(scheduler=_Scheduler("old")) if has_old else None
    strategy.schedule(new, old, progress)
    assert new.scheduler.calls == _before(strategy.fresh, isinstance(strategy, LoadedStart), has_old, progress)
    assert old is None or old.scheduler.calls == []
