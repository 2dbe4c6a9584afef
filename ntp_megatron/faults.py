"""Failure injection: ``--inject-failure ACTION:rank=R,iter=N[,code=C]``, triggered inside the rank.

Actions: ``kill`` — the rank SIGKILLs itself (a dead GPU/host: no cleanup, no goodbye); ``exit`` — the rank
exits with ``code`` (default 1), as a crashing program would. A spec fires once, in the rank it names, just
before it starts 1-based iteration ``iter``. The launcher validates the specs and hands them to the ranks
in an environment variable.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass
from typing import Iterable, Literal, Sequence

from ntp_megatron.config_io import ConfigError

ENV_FAILURES = "NTP_INJECT_FAILURES"
ACTIONS = ("kill", "exit")


@dataclass(frozen=True)
class FailureSpec:
    action: Literal["kill", "exit"]
    rank: int
    iteration: int
    code: int = 1

    def __str__(self) -> str:
        extra = f",code={self.code}" if self.action == "exit" else ""
        return f"{self.action}:rank={self.rank},iter={self.iteration}{extra}"


_KEYS = {"rank": "rank", "iter": "iteration", "iteration": "iteration", "code": "code"}


def parse_failure_spec(text: str, world_size: int | None = None) -> FailureSpec:
    """Parse one ``--inject-failure`` value; raises ConfigError naming what is wrong and what is allowed."""
    usage = "expected ACTION:rank=R,iter=N[,code=C] with ACTION in kill, exit (e.g. kill:rank=1,iter=5)"
    action, sep, rest = text.partition(":")
    if not sep or action not in ACTIONS:
        raise ConfigError(f"--inject-failure {text!r}: {usage}")
    fields: dict[str, int] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in _KEYS:
            raise ConfigError(f"--inject-failure {text!r}: unknown field {key!r}; allowed: rank, iter, code")
        try:
            fields[_KEYS[key]] = int(value)
        except ValueError:
            raise ConfigError(f"--inject-failure {text!r}: {key} must be an integer, got {value!r}") from None
    for required in ("rank", "iteration"):
        if required not in fields:
            raise ConfigError(f"--inject-failure {text!r}: missing {'iter' if required == 'iteration' else required}; {usage}")
    if "code" in fields and action != "exit":
        raise ConfigError(f"--inject-failure {text!r}: code applies to the exit action only")
    spec = FailureSpec(action=action, **fields)  # type: ignore[arg-type]
    if spec.iteration < 1:
        raise ConfigError(f"--inject-failure {text!r}: iter must be ≥ 1")
    if world_size is not None and not 0 <= spec.rank < world_size:
        raise ConfigError(f"--inject-failure {text!r}: rank must be in 0..{world_size - 1}")
    if spec.action == "exit" and not 1 <= spec.code <= 255:
        raise ConfigError(f"--inject-failure {text!r}: code must be in 1..255")
    return spec


def to_env(specs: Sequence[FailureSpec]) -> str:
    return json.dumps([asdict(s) for s in specs])


def from_env(environ: dict[str, str] | None = None) -> list[FailureSpec]:
    raw = (environ if environ is not None else os.environ).get(ENV_FAILURES)
    return [FailureSpec(**item) for item in json.loads(raw)] if raw else []


class FailureTrigger:
    """The in-rank side: call :meth:`before_iteration` at the start of every iteration."""

    def __init__(self, rank: int, specs: Iterable[FailureSpec]) -> None:
        self._mine = {s.iteration: s for s in specs if s.rank == rank}

    def before_iteration(self, iteration: int) -> None:
        spec = self._mine.pop(iteration, None)
        if spec is None:
            return
        print(f"injected failure: {spec}", flush=True)
        if spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(spec.code)
