"""Every order of the store operations of a few actors, run deterministically in one process.

The protocol's writers (a rank's vote, the controller's abort, a rank's ``complete`` against the controller's
``incomplete``) race only through store operations. :func:`every_order` runs a trial once per order of the
*watched* operations of its actors that can make a difference, depth first, so no order is left to chance:

- each actor runs in its own thread on a proxy of one shared store (:meth:`Interleaving.proxy`); an operation on
  a watched key waits for its turn, and one actor at a time is let through, every other actor being parked at
  its next watched operation or finished;
- two orders that differ only in the order of independent operations (different keys, or two reads of one
  key) end in the same state, so only one of them is run (the partial-order reduction known as sleep sets);
  every order of every pair of dependent operations is run (``reduce=False`` runs every order, equivalent or
  not: the tests check that both reach the same observations);
- an operation on a key that is not watched runs at once. That is sound only if no other actor touches the key
  while one of them writes it (it is then independent of everything the others do); every run checks this,
  so a trial that watches too little fails instead of silently missing orders;
- a ``wait`` can be let through only once its keys exist, unless nothing else can move: then it runs and times
  out on the store's timeout, as a rank would (so a trial shows a bounded wait, never a hang);
- ``kill={actor: n}`` stops that actor just before its ``n``-th watched operation (0-based), like a SIGKILL: it
  raises :class:`Killed` there and never touches the store again.

A proxy passes every call through, ungated, outside its actor's thread (set-up code, a controller's reporting
thread), so the objects under test can be built on it before the run.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable, NamedTuple, Optional

import torch.distributed as dist

STEP_TIMEOUT_S = 10.0
"""How long an actor may run between two watched operations before the run counts as hung."""


class Killed(BaseException):
    """The actor was stopped before a store operation (a simulated SIGKILL)."""


class Hang(AssertionError):
    """An actor neither reached a watched operation nor finished within :data:`STEP_TIMEOUT_S`."""


class Op(NamedTuple):
    name: str
    keys: tuple[str, ...]
    writes: bool

    def depends_on(self, other: "Op") -> bool:
        """Their order can matter: a common key, and one of them writes it."""
        return bool(set(self.keys) & set(other.keys)) and (self.writes or other.writes)


Chooser = Callable[[int, list[str], dict[str, Op]], str]


def first(step: int, options: list[str], pending: dict[str, Op]) -> str:
    return options[0]


@dataclass
class Interleaving:
    store: dist.Store
    watch: Callable[[str], bool]
    choose: Chooser = first
    """Which of the actors that can go (sorted by name) goes at each step."""
    kill: dict[str, int] = field(default_factory=dict)
    trace: list[tuple[str, str, str]] = field(default_factory=list)
    """(actor, operation, key) of every watched operation, in the order they ran."""
    seen: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    """Per actor, (operation, what it returned) of each of its watched operations: what the actor observed."""

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._proxies: dict[str, _Proxy] = {}
        self._parked: dict[str, Op] = {}
        self._done: set[str] = set()
        self._turn: Optional[str] = None
        self._counts: dict[str, int] = {}
        self._touched: dict[str, dict[str, bool]] = {}  # unwatched key -> actor -> wrote it

    def proxy(self, actor: str) -> "_Proxy":
        if actor not in self._proxies:
            self._proxies[actor] = _Proxy(self.store, self, actor)
        return self._proxies[actor]

    def run(self, actors: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        """Run the actors to the end in the order ``choose`` picks; returns each one's result or exception."""
        results: dict[str, Any] = {}
        threads = [threading.Thread(target=self._actor, args=(name, fn, self.proxy(name), results), daemon=True)
                   for name, fn in sorted(actors.items())]
        for thread in threads:
            thread.start()
        step = 0
        with self._cond:
            while True:
                if not self._cond.wait_for(lambda: self._turn is None and len(self._parked) + len(self._done)
                                           == len(actors), timeout=STEP_TIMEOUT_S):
                    running = sorted(set(actors) - set(self._parked) - self._done)
                    raise Hang(f"actors {running} did not reach a store operation; trace so far {self.trace}")
                if not self._parked:
                    break
                parked = sorted(self._parked)
                ready = [a for a in parked if self._parked[a].name != "wait"
                         or self.store.check(list(self._parked[a].keys))]
                options = ready or parked  # nothing else can move: a blocked wait runs into its timeout
                actor = self.choose(step, options, {a: self._parked[a] for a in options})
                op = self._parked.pop(actor)
                self.trace.append((actor, op.name, ",".join(op.keys)))
                self._turn = actor
                self._cond.notify_all()
                step += 1
        for thread in threads:
            thread.join(timeout=STEP_TIMEOUT_S)
        self._check_unwatched()
        return results

    def _actor(self, name: str, fn: Callable[[], Any], proxy: "_Proxy", results: dict[str, Any]) -> None:
        proxy.owner = threading.get_ident()
        try:
            results[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - the trial inspects it
            results[name] = exc
        finally:
            proxy.owner = None
            with self._cond:
                self._done.add(name)
                self._cond.notify_all()

    def _gate(self, actor: str, op: Op) -> None:
        with self._cond:
            self._parked[actor] = op
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._turn == actor, timeout=STEP_TIMEOUT_S * 2):
                raise Hang(f"{actor} never got its turn for {op}")
            self._turn = None
            n = self._counts.get(actor, 0)
            self._counts[actor] = n + 1
            if self.kill.get(actor) == n:
                raise Killed(f"{actor} killed before {op.name} {op.keys}")

    def _note(self, actor: str, op: Op) -> None:
        with self._cond:
            for key in op.keys:
                by = self._touched.setdefault(key, {})
                by[actor] = by.get(actor, False) or op.writes

    def _check_unwatched(self) -> None:
        for key, by in self._touched.items():
            if len(by) > 1 and any(by.values()):
                raise AssertionError(f"unwatched key {key!r} is shared by {sorted(by)} and written: watch it, or "
                                     "orders of its operations are never tried")


class _Proxy:
    """A store for one actor: watched operations from the actor's own thread wait for their turn."""

    def __init__(self, store: dist.Store, interleaving: Interleaving, actor: str) -> None:
        self._store, self._il, self.actor = store, interleaving, actor
        self.owner: Optional[int] = None

    def _call(self, name: str, keys: Iterable[str], writes: bool, fn: Callable[[], Any]) -> Any:
        if self.owner != threading.get_ident():
            return fn()
        op = Op(name, tuple(keys), writes)
        if not any(self._il.watch(k) for k in op.keys):
            self._il._note(self.actor, op)
            return fn()
        self._il._gate(self.actor, op)
        try:
            result = fn()
        except Exception as exc:
            self._il.seen[self.actor].append((op.name, type(exc).__name__))
            raise
        self._il.seen[self.actor].append((op.name, result))
        return result

    def add(self, key: str, amount: int) -> int:
        return self._call("add", [key], amount != 0, lambda: self._store.add(key, amount))

    def set(self, key: str, value) -> None:
        return self._call("set", [key], True, lambda: self._store.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call("get", [key], False, lambda: self._store.get(key))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys, False, lambda: self._store.check(keys))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", [key], True, lambda: self._store.compare_set(key, expected, desired))

    def wait(self, keys: list[str], *timeout: timedelta) -> None:
        return self._call("wait", keys, False, lambda: self._store.wait(keys, *timeout))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", [key], True, lambda: self._store.delete_key(key))


def hash_store(timeout_s: float = 5.0) -> dist.HashStore:
    """An in-memory store whose waits (``wait``, ``get`` of a missing key) end after ``timeout_s`` (by default
    long enough that a rank thread's wait never ends on a busy machine before the test lets it through)."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


@dataclass
class _Node:
    options: list[str]
    pending: dict[str, Op]
    sleep: set[str]
    choice: str
    done: list[str] = field(default_factory=list)
    redundant: bool = False
    """Every option sleeps: this order is equivalent to one already run (finished, never branched)."""


class _Explorer:
    """Depth-first search over the choices, one run per path, with sleep sets (``reduce``) or without."""

    def __init__(self, reduce: bool = True) -> None:
        self.stack: list[_Node] = []
        self.reduce = reduce

    def choose(self, step: int, options: list[str], pending: dict[str, Op]) -> str:
        if step < len(self.stack):
            node = self.stack[step]
            assert node.options == options and node.pending == pending, \
                f"the actors are not deterministic: at step {step} {pending}, before {node.pending}"
            return node.choice
        sleep: set[str] = set()
        redundant = False
        if self.stack and self.reduce:
            parent = self.stack[-1]
            redundant = parent.redundant
            went = parent.pending[parent.choice]
            sleep = {a for a in parent.sleep | set(parent.done)
                     if a in pending and not parent.pending[a].depends_on(went)}
        awake = [a for a in options if a not in sleep]
        node = _Node(options, pending, sleep, (awake or options)[0], redundant=redundant or not awake)
        self.stack.append(node)
        return node.choice

    def next_path(self) -> bool:
        """Move to the next path not run yet; False when there is none."""
        while self.stack:
            node = self.stack[-1]
            node.done.append(node.choice)
            rest = [a for a in node.options if a not in node.sleep and a not in node.done]
            if rest and not node.redundant:
                node.choice = rest[0]
                return True
            self.stack.pop()
        return False

    @property
    def redundant(self) -> bool:
        return bool(self.stack) and self.stack[-1].redundant


def every_order(trial: Callable[[Interleaving], None], watch: Callable[[str], bool],
                kill: Optional[dict[str, int]] = None, limit: int = 5000,
                reduce: bool = True) -> list[list[tuple[str, str, str]]]:
    """Run ``trial`` (which builds its case on ``il.store`` and ``il.proxy``, calls ``il.run`` once and checks
    the outcome) for every order of the dependent watched operations, on a fresh store each time; returns the
    trace of each order (runs found equivalent to an earlier one midway are finished and checked, not counted).
    ``reduce=False``: every order of the watched operations, equivalent or not."""
    explorer = _Explorer(reduce)
    traces = []
    while True:
        il = Interleaving(hash_store(), watch, choose=explorer.choose, kill=dict(kill or {}))
        trial(il)
        if not explorer.redundant:
            traces.append(il.trace)
        if len(traces) > limit:
            raise AssertionError(f"more than {limit} orders: watch fewer operations")
        if not explorer.next_path():
            return traces
