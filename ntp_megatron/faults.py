"""Failure injection: the ``--inject-failure`` grammar, the in-rank trigger, and the controller-side killers.

In-rank (the rank does it to itself, at a chosen point of a chosen iteration)::

    ACTION:rank=R,iter=N[,phase=P][,code=C]

``ACTION``: ``kill`` (SIGKILL: a dead GPU or host, no cleanup), ``hang`` (SIGSTOP: the process stops
responding, as a hung GPU does; the launcher fences it), ``exit`` (exit code C, default 1, as a crashing
program would), ``error`` (raise :class:`InjectedError` there, as a bug of ours or a failed write would: the
rank reports an error of its own and the job stops naming it, with no re-formation), ``oom`` (raise
``torch.OutOfMemoryError`` there, as a device that ran out of memory does: under NTP, on a rank of a degraded
replica — its layout does not fit — the controller drops that replica under ``ntp.on_unrecoverable:
drop_replica`` and stops the job otherwise, at once; see :mod:`ntp_megatron.elastic.controller`), ``spin`` (the
process busy-loops with its heartbeat alive, as a rank stuck in a kernel does: with ``ntp.progress_fence`` NTP's
launcher fences it by its progress, :mod:`ntp_megatron.elastic.agent`, and without it its peers wait for
``parallel.timeout_s``; one of the phases ``SPIN_PHASES``). ``R`` is the *launch
rank*: a process's identity for the whole run (process-group ranks are renumbered by every re-formation; launch
ranks never are). ``N`` is the 1-based iteration. ``P``:

- ``start`` (default): before iteration N begins;
- ``forward``: inside the forward pass of N, at its middle micro-batch;
- ``backward``: inside the backward pass of N, when the middle micro-batch's backward begins;
- ``grad_sync``: during the cross-replica gradient sync of N;
- ``optimizer``: after this rank has voted to commit N and before its own parameter update;
- ``param_gather``: after this rank's parameter update of N, before the parameter all-gather that follows it
  under ``parallel.use_distributed_optimizer`` (without it nothing is gathered: the point is right after the
  update). Iteration N counts as done there; the re-formation after a failure re-gathers every rank's
  parameters from the optimizer shards;
- ``checkpoint``: during a checkpoint save (only where checkpoints are saved);
- ``checkpoint_write``: in the checkpoint save after iteration N, as Megatron-Core collects this rank's write
  results (an async save: where it is finalized, later; N is still the save's iteration). ``error`` here is a
  failed write, as a full disk or an I/O error makes it: it takes upstream's own path (the write results are
  gathered, every rank's save raises), not an exception of ours;
- ``eval``: in the evaluation after iteration N, before its middle batch (N must be an evaluation iteration: a
  multiple of ``training.eval_interval``, or ``train_iters`` for the final one);
- ``reform``: in the first re-formation this process takes part in at iteration N or later (a re-formation
  counts as the iteration it resumes at, in every rank alike; NTP only: after joining the new generation and
  building its objects, before units move) — a second failure in the middle of a re-formation after
  another rank's failure, or a replacement process dying while it is being admitted;
- ``connect``: inside the first gloo connect of a forming generation at iteration N or later that is still under way
  50 ms after it began (NTP on gloo only; a process that has not trained yet counts the iteration after the last
  committed one): the rank's address is published, so its peers go on to connect to it — a death in the middle of
  a rendezvous, e.g. a replacement that dies while its admission forms (it arrives first and waits for the others).

A slow rank (the rank paces itself: not a failure, nothing dies)::

    slow:rank=R,factor=F[,iter=N]

From iteration N (default 1) on, launch rank R's compute takes F times as long (F >= 1; ``factor=1`` ends an
earlier slowdown): at every micro-batch and at the start of the gradient sync the rank sleeps F - 1 times the
compute time it spent since the last such point (waits on its peers excluded,
:func:`ntp_megatron.phases.compute_clock`), as a GPU held back by its clocks would (the model is NVIDIA Resiliency
Extension's GPU_SLEEP). On a GPU the device sleeps instead (:class:`DeviceSlowdown`: a spin kernel for F - 1 times
the previous iteration's device-measured compute). Several ``slow``
specs for one rank make a timeline. Under NTP the controller rebalances a slow rank's replica
(:mod:`ntp_megatron.plan.rebalance`).

Controller-side (the launcher does it from outside)::

    kill:rank=R,after=S                              SIGKILL launch rank R at S seconds of wall time
    random:mtbf=S[,seed=K][,max=M][,action=kill|hang]   kill (or hang) random live ranks, exponential gaps of mean S
    random:mtbf=S[,seed=K][,max=M],kinds=K1+K2+...      a kind drawn among kill, exit, hang, spin, slow each time

With ``kinds`` (a soak, :mod:`ntp_megatron.bench.soak`) each failure is a :class:`Draw`: its kind, then a phase drawn
from the kind's valid phases in this job (:func:`random_phases`; ``outside``: the launcher's own signal, wherever the
rank is, as without ``kinds``), for ``slow`` a factor and a number of iterations (then factor 1). The launcher *arms*
a victim with an in-rank draw through its store (:func:`ntp_megatron.elastic.keys.arm`); the rank takes it at the
start of its next iteration and fires at that phase of it (or of the first re-formation, checkpoint save... after it,
for phases outside an iteration). Everything drawn but the victim is a function of the seed alone
(:meth:`RandomFailures.draws`). A lost host is not a kind yet (:data:`LATER_KINDS`).

Every spec fires at most once per run, also across restarts from a checkpoint (the launcher's store records
what fired). A bad spec is one line naming the problem (exit code 2).

The training code names its phases through :mod:`ntp_megatron.phases`; :func:`install` plugs a rank's trigger
into it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Literal, Optional, Sequence, Union

import torch

from ntp_megatron import phases
from ntp_megatron.config.files import ConfigError

ENV_FAILURES = "NTP_INJECT_FAILURES"
ACTIONS = ("kill", "hang", "exit", "error", "oom", "spin")
PHASES = ("start", "forward", "backward", "grad_sync", "optimizer", "param_gather", "checkpoint", "checkpoint_write",
          "eval", "reform", "connect")
FORMATION_PHASES = ("reform", "connect")
"""Phases of a re-formation: due in the first one at iteration N or later (not only in iteration N)."""
SPIN_PHASES = phases.ITERATION
"""Where ``spin`` may fire: the phases of an iteration (its start mark to the parameter all-gather), where the
launcher takes a rank that makes no progress while its peers wait on it for a stuck one
(:data:`ntp_megatron.phases.ITERATION`)."""
USAGE = ("expected ACTION:rank=R,iter=N[,phase=P][,code=C] (ACTION in kill, hang, exit, error, oom, spin; P in "
         f"{', '.join(PHASES)}), kill:rank=R,after=S, slow:rank=R,factor=F[,iter=N], or "
         "random:mtbf=S[,seed=K][,max=M][,action=kill|hang | ,kinds=K1+K2...]")
RANDOM_KINDS = ("kill", "exit", "hang", "spin", "slow")
"""What ``random:...,kinds=`` may draw: failures NTP absorbs (``error`` and ``oom`` stop the job by design) and a slow
rank."""
LATER_KINDS = {"host": "a lost host (every rank of one launcher at once) needs several launchers and the lost-host "
                       "detection being built; not a random kind yet"}
"""Kinds a soak should draw one day, refused with the reason (a ``host`` kind fits :class:`Draw` as it is: the
launcher would pick a node instead of a rank)."""
OUTSIDE = "outside"
"""The phase of a kill or hang the launcher does itself with a signal, wherever the rank is (start-up, a store wait,
an iteration): what ``random:`` without ``kinds`` does."""
SLOW_FACTORS = (1.5, 4.0)
"""A drawn slowdown's factor: uniform in this range, to one decimal."""
SLOW_ITERATIONS = (3, 30)
"""A drawn slowdown lasts this many iterations (inclusive range), then its factor is 1 again."""


@dataclass(frozen=True)
class RankFailure:
    """A failure the rank triggers in itself."""

    action: Literal["kill", "hang", "exit", "error", "oom", "spin"]
    rank: int
    iteration: int
    phase: str = "start"
    code: int = 1

    def __str__(self) -> str:
        text = f"{self.action}:rank={self.rank},iter={self.iteration}"
        if self.phase != "start":
            text += f",phase={self.phase}"
        return text + (f",code={self.code}" if self.action == "exit" else "")


@dataclass(frozen=True)
class TimedKill:
    """The launcher SIGKILLs launch rank ``rank`` ``after_s`` seconds after the job started."""

    rank: int
    after_s: float

    def __str__(self) -> str:
        return f"kill:rank={self.rank},after={self.after_s:g}"


@dataclass(frozen=True)
class Draw:
    """One failure of a ``random:...,kinds=`` spec: when (seconds after the first iteration), what, where."""

    at_s: float
    kind: str
    phase: str
    """A phase of :data:`PHASES`, or :data:`OUTSIDE` (the launcher's signal); ``start`` for ``slow``."""
    factor: float = 1.0
    """``slow`` only: how many times as long the rank computes."""
    iterations: int = 0
    """``slow`` only: for how many iterations."""

    @property
    def outside(self) -> bool:
        return self.phase == OUTSIDE

    def spec(self, rank: int, iteration: int) -> Union["RankFailure", "SlowRank"]:
        """The in-rank spec this draw becomes in launch rank ``rank``, armed at the start of ``iteration``."""
        if self.kind == "slow":
            return SlowRank(rank=rank, factor=self.factor, iteration=iteration)
        return RankFailure(action=self.kind, rank=rank, iteration=iteration, phase=self.phase)  # type: ignore[arg-type]

    def to_json(self) -> dict:
        return asdict(self)


def random_phases(kind: str, ntp: bool = True, checkpoints: bool = False, gloo: bool = True,
                  progress_fence: bool = True) -> tuple[str, ...]:
    """The phases a random failure of ``kind`` may be drawn at in a job (a pure function of the job's settings):
    every phase where the in-rank spec would be valid (:func:`parse_failure_spec`) and is sure to come; ``eval``
    never (only evaluation iterations have one), ``connect`` only on gloo. Empty: the kind cannot happen here."""
    if kind == "slow":
        return ("start",)
    if kind == "spin":
        return SPIN_PHASES if ntp and progress_fence else ()
    pool = list(phases.ITERATION)
    if ntp:
        pool += ["reform", "connect"] if gloo else ["reform"]
    if checkpoints:
        pool += ["checkpoint", "checkpoint_write"]
    return tuple([OUTSIDE, *pool] if kind in ("kill", "hang") else pool)


@dataclass(frozen=True)
class RandomFailures:
    """The launcher kills (or hangs) a random live rank after exponentially distributed gaps of mean ``mtbf_s``;
    with ``kinds``, a failure of a kind drawn among them each time, at a drawn phase (:meth:`draws`)."""

    mtbf_s: float
    seed: int = 0
    max: Optional[int] = None
    action: Literal["kill", "hang"] = "kill"
    kinds: tuple[str, ...] = ()
    """Empty: every failure is ``action`` from outside (the grammar before ``kinds``, drawn as it was)."""
    pools: tuple[tuple[str, ...], ...] = ()
    """Per kind of :attr:`kinds`, the phases it is drawn at in this job (:func:`random_phases`)."""

    def __str__(self) -> str:
        text = f"random:mtbf={self.mtbf_s:g},seed={self.seed}" + (f",max={self.max}" if self.max is not None else "")
        return text + (f",kinds={'+'.join(self.kinds)}" if self.kinds else f",action={self.action}")

    def draws(self) -> Iterable[tuple[Draw, random.Random]]:
        """Every failure of the run (with the generator that then picks the victim among the live ranks). The gaps
        and the victims come from ``Random(seed)`` as :meth:`schedule`'s; kinds, phases, factors and durations from
        a second generator of the seed, so they do not depend on how many ranks were live at each draw."""
        what = random.Random(f"kinds/{self.seed}")
        kinds, pools = self.kinds or (self.action,), self.pools or ((OUTSIDE,),)
        for at, rng in self.schedule():
            i = what.randrange(len(kinds))
            kind, phase = kinds[i], what.choice(pools[i])
            if kind == "slow":
                factor = round(what.uniform(*SLOW_FACTORS), 1)
                yield Draw(at, kind, phase, factor, what.randint(*SLOW_ITERATIONS)), rng
            else:
                yield Draw(at, kind, phase), rng

    def schedule(self) -> Iterable[tuple[float, random.Random]]:
        """Wall-clock offsets of successive failures (with the generator that then picks the victim)."""
        rng = random.Random(self.seed)
        t, n = 0.0, 0
        while self.max is None or n < self.max:
            t += rng.expovariate(1.0 / self.mtbf_s)
            n += 1
            yield t, rng


class DrawPacer:
    """Which random draws the launcher applies when (pure: the launcher says what is busy, and applies them).

    A draw at a phase waits, once armed, for its rank's next iteration (or re-formation): draws that came due while
    the ranks were stalled (a fence takes seconds) would all fire in the same one, a burst nobody drew. So at most one
    armed draw of each class — in an iteration, in a re-formation (:data:`FORMATION_PHASES`) — is outstanding; the
    others wait in order and keep their gaps: the next is due its gap (after the draw of its class before it) after
    the outstanding one fired. Draws from outside and slowdowns are due at their drawn times."""

    def __init__(self, specs: Sequence[RandomFailures]) -> None:
        self._next = [(str(s), next(gen, None), gen) for s in specs for gen in [iter(s.draws())]]
        self.deferred: dict[bool, list[tuple[float, Draw, random.Random, str]]] = {False: [], True: []}
        """Per class (in a re-formation or not): (gap, draw, victim generator, spec) waiting."""
        self._last_at = {False: 0.0, True: 0.0}
        self._freed: dict[bool, Optional[float]] = {False: None, True: None}
        """When each class's outstanding draw was first seen fired while others of the class wait."""

    def due(self, clock: float, busy: Callable[[bool], bool],
            apply: Callable[[Draw, random.Random, str], None] = lambda *_: None) -> list[tuple[Draw, random.Random, str]]:
        """The draws to apply at ``clock`` (seconds since the first iteration), each handed to ``apply`` as it comes
        (before the next is drawn: gaps and victims share one generator, in :meth:`RandomFailures.schedule`'s order);
        ``busy(forming)``: whether an armed draw of that class has not fired yet."""
        out: list[tuple[Draw, random.Random, str]] = []
        taken: set[bool] = set()

        def hand(draw: Draw, rng: random.Random, spec: str) -> None:
            apply(draw, rng, spec)
            out.append((draw, rng, spec))

        for forming, queue in self.deferred.items():
            if not queue or busy(forming):
                self._freed[forming] = None
                continue
            freed = self._freed[forming] = clock if self._freed[forming] is None else self._freed[forming]
            if clock - freed >= queue[0][0]:
                _, draw, rng, spec = queue.pop(0)
                self._freed[forming] = None
                hand(draw, rng, spec)
                taken.add(forming)
        updated = []
        for spec, due, gen in self._next:
            while due is not None and clock >= due[0].at_s:
                draw, rng = due
                forming = draw.phase in FORMATION_PHASES
                if draw.outside or draw.kind == "slow":
                    hand(draw, rng, spec)
                else:
                    gap, self._last_at[forming] = draw.at_s - self._last_at[forming], draw.at_s
                    if forming in taken or busy(forming) or self.deferred[forming]:
                        self.deferred[forming].append((gap, draw, rng, spec))
                    else:
                        hand(draw, rng, spec)
                        taken.add(forming)
                due = next(gen, None)
            updated.append((spec, due, gen))
        self._next = updated
        return out


@dataclass(frozen=True)
class SlowRank:
    """From iteration ``iteration`` on, launch rank ``rank`` computes ``factor`` times as long (1: normal again)."""

    rank: int
    factor: float
    iteration: int = 1

    def __str__(self) -> str:
        return f"slow:rank={self.rank},factor={self.factor:g},iter={self.iteration}"


FailureSpec = Union[RankFailure, TimedKill, RandomFailures, SlowRank]


def _fields(text: str, rest: str, allowed: dict[str, type]) -> dict:
    out: dict = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise ConfigError(f"--inject-failure {text!r}: unknown field {key!r}; allowed here: "
                              f"{', '.join(allowed)}")
        if key in out:
            raise ConfigError(f"--inject-failure {text!r}: field {key!r} given twice")
        kind = allowed[key]
        if kind is str:
            out[key] = value
            continue
        try:
            out[key] = kind(value)
        except ValueError:
            raise ConfigError(f"--inject-failure {text!r}: {key} must be {'an integer' if kind is int else 'a number'}"
                              f", got {value!r}") from None
    return out


def parse_failure_spec(text: str, world_size: Optional[int] = None, train_iters: Optional[int] = None,
                       checkpoints: bool = False, ntp: bool = True, resumes_after: int = 0,
                       eval_interval: Optional[int] = None, gloo: bool = True,
                       progress_fence: bool = True) -> FailureSpec:
    """Parse one ``--inject-failure`` value; raises ConfigError naming what is wrong and what is allowed.

    ``world_size``: launch ranks are 0..world_size-1. ``train_iters``: an iteration past the run never fires,
    so it is refused; so is one at or before ``resumes_after``, the iteration of the checkpoint the run resumes
    from. ``checkpoints``: whether the run saves checkpoints (phase ``checkpoint`` needs it). ``eval_interval``:
    the run's evaluation interval, None if it does not evaluate (phase ``eval`` needs one). ``gloo`` (the backend is
    sure to be gloo) and ``progress_fence`` (``ntp.progress_fence``): which phases ``random:...,kinds=`` draws.
    """
    action, sep, rest = text.partition(":")
    if not sep or action not in (*ACTIONS, "random", "slow"):
        raise ConfigError(f"--inject-failure {text!r}: {USAGE}")
    if action == "slow":
        return _slow_rank(text, rest, world_size, train_iters)
    if action == "random":
        return _random_failures(text, rest, ntp, checkpoints, gloo, progress_fence)
    if "after=" in rest:
        return _timed_kill(text, action, rest, world_size)
    f = _fields(text, rest, {"rank": int, "iter": int, "phase": str, "code": int})
    for required in ("rank", "iter"):
        if required not in f:
            raise ConfigError(f"--inject-failure {text!r}: missing {required}; {USAGE}")
    if "code" in f and action != "exit":
        raise ConfigError(f"--inject-failure {text!r}: code applies to the exit action only")
    phase = f.get("phase", "start")
    _check_phase(text, action, phase, f["iter"], train_iters, checkpoints, ntp, eval_interval)
    spec = RankFailure(action=action, rank=f["rank"], iteration=f["iter"], phase=phase,  # type: ignore[arg-type]
                       code=f.get("code", 1))
    if spec.iteration < 1:
        raise ConfigError(f"--inject-failure {text!r}: iter must be ≥ 1")
    if train_iters is not None and spec.iteration > train_iters:
        raise ConfigError(f"--inject-failure {text!r}: iter {spec.iteration} is past training.train_iters "
                          f"({train_iters}); it would never fire")
    if spec.iteration <= resumes_after:
        raise ConfigError(f"--inject-failure {text!r}: iter {spec.iteration} is not after iteration {resumes_after}, "
                          "where the run resumes from its checkpoint; it would never fire")
    _check_rank(text, spec.rank, world_size)
    if spec.action == "exit" and not 1 <= spec.code <= 255:
        raise ConfigError(f"--inject-failure {text!r}: code must be in 1..255")
    return spec


def _slow_rank(text: str, rest: str, world_size: Optional[int], train_iters: Optional[int]) -> SlowRank:
    """``slow:rank=R,factor=F[,iter=N]`` (:func:`parse_failure_spec`)."""
    f = _fields(text, rest, {"rank": int, "factor": float, "iter": int})
    for required in ("rank", "factor"):
        if required not in f:
            raise ConfigError(f"--inject-failure {text!r}: missing {required}; expected slow:rank=R,factor=F"
                              "[,iter=N]")
    if not 1 <= f["factor"] <= 100:
        raise ConfigError(f"--inject-failure {text!r}: factor must be in 1..100 (1 ends a slowdown), got "
                          f"{f['factor']:g}")
    slow = SlowRank(rank=f["rank"], factor=f["factor"], iteration=f.get("iter", 1))
    if slow.iteration < 1:
        raise ConfigError(f"--inject-failure {text!r}: iter must be ≥ 1")
    if train_iters is not None and slow.iteration > train_iters:
        raise ConfigError(f"--inject-failure {text!r}: iter {slow.iteration} is past training.train_iters "
                          f"({train_iters}); it would never take effect")
    _check_rank(text, slow.rank, world_size)
    return slow


def _random_failures(text: str, rest: str, ntp: bool = True, checkpoints: bool = False, gloo: bool = True,
                     progress_fence: bool = True) -> RandomFailures:
    """``random:mtbf=S[,seed=K][,max=M][,action=kill|hang | ,kinds=K1+K2...]`` (:func:`parse_failure_spec`)."""
    f = _fields(text, rest, {"mtbf": float, "seed": int, "max": int, "action": str, "kinds": str})
    if "mtbf" not in f:
        raise ConfigError(f"--inject-failure {text!r}: missing mtbf (mean seconds between failures)")
    if f["mtbf"] <= 0:
        raise ConfigError(f"--inject-failure {text!r}: mtbf must be > 0")
    if f.get("max") is not None and f["max"] < 1:
        raise ConfigError(f"--inject-failure {text!r}: max must be ≥ 1")
    if f.get("action", "kill") not in ("kill", "hang"):
        raise ConfigError(f"--inject-failure {text!r}: action must be kill or hang, got {f['action']!r}")
    kinds, pools = _random_kinds(text, f, ntp, checkpoints, gloo, progress_fence) if "kinds" in f else ((), ())
    return RandomFailures(mtbf_s=f["mtbf"], seed=f.get("seed", 0), max=f.get("max"), action=f.get("action", "kill"),
                          kinds=kinds, pools=pools)


def _random_kinds(text: str, f: dict, ntp: bool, checkpoints: bool, gloo: bool,
                  progress_fence: bool) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """The ``kinds`` of a random spec and each one's phases in this job (:func:`_random_failures`)."""
    if "action" in f:
        raise ConfigError(f"--inject-failure {text!r}: give kinds or action, not both (kinds=hang is action=hang at "
                          "a drawn phase)")
    kinds = tuple(f["kinds"].split("+"))
    for kind in kinds:
        if kind in LATER_KINDS:
            raise ConfigError(f"--inject-failure {text!r}: kind {kind!r} is not supported yet: {LATER_KINDS[kind]}")
        if kind not in RANDOM_KINDS:
            raise ConfigError(f"--inject-failure {text!r}: kinds must be some of {', '.join(RANDOM_KINDS)} joined by "
                              f"'+', got {kind!r}")
    if len(set(kinds)) != len(kinds):
        raise ConfigError(f"--inject-failure {text!r}: kinds names a kind twice")
    pools = tuple(random_phases(k, ntp, checkpoints, gloo, progress_fence) for k in kinds)
    for kind, pool in zip(kinds, pools):
        if not pool:
            raise ConfigError(f"--inject-failure {text!r}: kind spin needs ntp.enabled and ntp.progress_fence (NTP's "
                              "launcher fences a spinning rank by its progress)")
    return kinds, pools


def _timed_kill(text: str, action: str, rest: str, world_size: Optional[int]) -> TimedKill:
    """``kill:rank=R,after=S`` (:func:`parse_failure_spec`)."""
    if action != "kill":
        raise ConfigError(f"--inject-failure {text!r}: after= applies to kill only (kill:rank=R,after=S)")
    f = _fields(text, rest, {"rank": int, "after": float})
    if "rank" not in f:
        raise ConfigError(f"--inject-failure {text!r}: missing rank; {USAGE}")
    if f["after"] < 0:
        raise ConfigError(f"--inject-failure {text!r}: after must be ≥ 0 seconds")
    _check_rank(text, f["rank"], world_size)
    return TimedKill(rank=f["rank"], after_s=f["after"])


def _check_phase(text: str, action: str, phase: str, iteration: int, train_iters: Optional[int], checkpoints: bool,
                 ntp: bool, eval_interval: Optional[int]) -> None:
    """Whether ``action`` can fire in ``phase`` at ``iteration`` of this run (:func:`parse_failure_spec`)."""
    if phase not in PHASES:
        raise ConfigError(f"--inject-failure {text!r}: phase must be one of {', '.join(PHASES)}, got {phase!r}")
    if action == "spin" and phase not in SPIN_PHASES:
        raise ConfigError(f"--inject-failure {text!r}: spin needs a phase of an iteration ({', '.join(SPIN_PHASES)}),"
                          f" got {phase!r}")
    if action == "spin" and not ntp:
        raise ConfigError(f"--inject-failure {text!r}: spin needs ntp.enabled (NTP's launcher fences a rank by its "
                          "progress; without NTP the job waits for parallel.timeout_s)")
    if phase in FORMATION_PHASES and not ntp:
        raise ConfigError(f"--inject-failure {text!r}: phase {phase} needs ntp.enabled (only NTP re-forms)")
    if phase in ("checkpoint", "checkpoint_write") and not checkpoints:
        raise ConfigError(f"--inject-failure {text!r}: phase {phase} needs checkpoints to be saved "
                          "(set checkpoint.save and checkpoint.save_interval)")
    if phase == "eval":
        if eval_interval is None:
            raise ConfigError(f"--inject-failure {text!r}: phase eval needs evaluation (set training.eval_interval "
                              "and training.eval_iters)")
        if iteration % eval_interval and iteration != train_iters:
            raise ConfigError(f"--inject-failure {text!r}: no evaluation follows iteration {iteration}: use a "
                              f"multiple of training.eval_interval ({eval_interval}) or training.train_iters")


def _check_rank(text: str, rank: int, world_size: Optional[int]) -> None:
    if rank < 0 or (world_size is not None and rank >= world_size):
        bound = f"0..{world_size - 1}" if world_size is not None else "≥ 0"
        raise ConfigError(f"--inject-failure {text!r}: rank must be a launch rank in {bound}")


def to_env(specs: Sequence[FailureSpec]) -> str:
    """The in-rank specs (failures and slowdowns), for the ranks' environment (controller-side ones stay in the
    launcher); ``{"armable": true}`` too when the launcher may arm ranks with random draws (:func:`armable`)."""
    items = [asdict(s) for s in specs if isinstance(s, (RankFailure, SlowRank))]
    if any(isinstance(s, RandomFailures) and any(p != (OUTSIDE,) for p in s.pools) for s in specs):
        items.append({"armable": True})
    return json.dumps(items)


def _env_items(environ: Optional[dict[str, str]]) -> list[dict]:
    raw = (environ if environ is not None else os.environ).get(ENV_FAILURES)
    return json.loads(raw) if raw else []


def from_env(environ: Optional[dict[str, str]] = None) -> list[Union[RankFailure, SlowRank]]:
    return [SlowRank(**item) if "factor" in item else RankFailure(**item)
            for item in _env_items(environ) if "armable" not in item]


def armable(environ: Optional[dict[str, str]] = None) -> bool:
    """Whether the launcher may arm this rank with a random draw: then it looks for one at every iteration's start (one
    store request; only in such runs)."""
    return any("armable" in item for item in _env_items(environ))


class InjectedError(RuntimeError):
    """What the ``error`` action raises: an exception of the rank's own code, not a failure of a peer."""


class FailureTrigger:
    """The in-rank side: :meth:`point` is called at every phase of every iteration (the hook of
    :mod:`ntp_megatron.phases`).

    ``fired(spec)`` says whether a spec already fired in this run (a restarted rank must not fail again);
    ``on_fire(spec)`` records the failure just before it happens (what, where, when), so the launcher can
    report it. Both talk to the launcher's store in a real run.
    """

    def __init__(self, launch_rank: int, specs: Iterable[RankFailure],
                 on_fire: Optional[Callable[[RankFailure], None]] = None,
                 fired: Optional[Callable[[RankFailure], bool]] = None,
                 take: Optional[Callable[[], Optional[dict]]] = None, slowdown: Optional["Slowdown"] = None) -> None:
        """``take``: the draw the launcher armed this rank with, if any (taken: it is gone from the store), read at
        every iteration's start; ``slowdown``: the pace a drawn ``slow`` changes."""
        self.rank = launch_rank
        self._mine = [s for s in specs if s.rank == launch_rank]
        self._on_fire = on_fire
        self._fired = fired
        self._take = take
        self._slowdown = slowdown
        self._armed: list[RankFailure] = []
        """Drawn failures: each fires at the first point of its phase at or after its iteration."""
        self.iteration = 0
        """The 1-based iteration in progress, for a :meth:`point` called without one."""

    def point(self, phase: str, iteration: Optional[int] = None) -> None:
        iteration = self.iteration if iteration is None else iteration
        if phase == "start" and self._take is not None:
            self._arm(iteration)
        for spec in self._armed:
            if spec.phase == phase and spec.iteration <= iteration:
                self._armed.remove(spec)
                self._fire(spec)
                return
        for spec in self._mine:
            due = spec.iteration <= iteration if phase in FORMATION_PHASES else spec.iteration == iteration
            if spec.phase == phase and due:
                self._mine.remove(spec)
                if self._fired is not None and self._fired(spec):
                    return
                self._fire(spec)
                return

    def _arm(self, iteration: int) -> None:
        """Take the draw the launcher armed this rank with, if any: a failure due from ``iteration`` on, or a
        slowdown from it (replacing one still in effect)."""
        raw = self._take()  # type: ignore[misc]
        if raw is None:
            return
        draw = Draw(**raw)
        spec = draw.spec(self.rank, iteration)
        if isinstance(spec, SlowRank):
            print(f"injected slowdown: {spec} for {draw.iterations} iterations", flush=True)
            if self._slowdown is not None:
                self._slowdown.slow_for(iteration, draw.factor, draw.iterations)
        else:
            self._armed.append(spec)

    def _fire(self, spec: RankFailure) -> None:
        print(f"injected failure: {spec}", flush=True)
        if self._on_fire is not None:
            self._on_fire(spec)
        if spec.action == "error":
            raise InjectedError(f"injected error ({spec})")
        if spec.action == "oom":
            raise torch.OutOfMemoryError(f"injected out-of-memory error ({spec})")
        if spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.action == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(3600)  # not reached unless someone sends SIGCONT: stay hung, the launcher fences us
        elif spec.action == "spin":
            _spin()
        os._exit(spec.code)


def _spin() -> None:
    """Busy-loop for good, holding a core: the interpreter still switches threads, so the heartbeat goes on while
    nothing else of the rank moves (the launcher fences it)."""
    while True:
        pass


class Slowdown:
    """The pace of a slow rank (:data:`ntp_megatron.phases.install_pace`): called at every micro-batch and phase
    point. From an iteration's ``start`` to the first point after its forward and backward passes (the gradient
    sync under NTP, else the optimizer step) it sleeps ``factor - 1`` times the compute time since the last call, so
    the rank's compute takes ``factor`` times as long while its waits on its peers stay what they are; elsewhere
    (optimizer step, evaluation, checkpoints) it does nothing."""

    WINDOW = ("start", "forward", "backward")

    def __init__(self, launch_rank: int, specs: Iterable[SlowRank],
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.timeline = sorted((s.iteration, s.factor) for s in specs if s.rank == launch_rank)
        self.sleep = sleep
        self._last: Optional[float] = None
        self.slept = 0.0
        """Seconds slept so far (what the slowdown added)."""

    def slow_for(self, iteration: int, factor: float, iterations: int) -> None:
        """``factor`` from ``iteration`` for ``iterations`` iterations, then 1 (a random draw): it replaces what the
        timeline said from ``iteration`` on."""
        kept = [(i, f) for i, f in self.timeline if i < iteration]
        self.timeline = [*kept, (iteration, factor), (iteration + iterations, 1.0)]

    def factor(self, iteration: int) -> float:
        factor = 1.0
        for start, f in self.timeline:
            if start <= iteration:
                factor = f
        return factor

    def __call__(self, kind: str = "point") -> None:
        iteration, phase = phases.current()
        now = phases.compute_clock()
        if phase == "start" and kind == "point":
            self._last = now  # an iteration begins: its compute is counted from here
            return
        if self._last is None:
            return
        extra = (self.factor(iteration) - 1.0) * (now - self._last)
        if extra > 0:
            self.sleep(extra)
            self.slept += extra
        # The passes go on (from the start mark through forward and backward), or they ended (the
        # gradient sync under NTP, else the optimizer step's point).
        self._last = phases.compute_clock() if phase in self.WINDOW else None


class DeviceSlowdown(Slowdown):
    """A slow rank on a GPU, where the host only enqueues: at the end of an iteration's passes (the first point
    after them) the device sleeps ``factor - 1`` times the previous iteration's compute (its device-measured
    passes, :class:`ntp_megatron.speed.compute_time.DeviceClock`, less what was slept in it), ``sleep`` being
    :class:`ntp_megatron.speed.compute_time.DeviceSleep`. Never ran here (no GPU)."""

    def __init__(self, launch_rank: int, specs: Iterable[SlowRank], sleep: Callable[[float], None]) -> None:
        super().__init__(launch_rank, specs, sleep)
        self._open = False
        self._slept_in: dict[int, float] = {}

    def __call__(self, kind: str = "point") -> None:
        iteration, phase = phases.current()
        if phase == "start" and kind == "point":
            self._open = True
            return
        if not self._open or phase in self.WINDOW:
            return
        self._open = False
        measured = phases.computed()
        if not measured:
            return
        last, seconds = measured[-1]
        extra = (self.factor(iteration) - 1.0) * max(0.0, seconds - self._slept_in.get(last, 0.0))
        if extra > 0:
            self.sleep(extra)
            self.slept += extra
            self._slept_in = {iteration: extra}  # only the last iteration's is read


def install(trigger: Optional[FailureTrigger]) -> None:
    """Make ``trigger`` the hook of every :func:`ntp_megatron.phases.point` (one per rank process; None: none)."""
    phases.install(trigger.point if trigger is not None else None)
