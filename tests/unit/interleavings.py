"""Every order of the store operations of a few actors, run deterministically in one process.

The protocol's writers (a rank's vote, the controller's abort, a rank's ``complete`` against the controller's
``incomplete``) race only through store operations. :func:`every_order` runs a trial once per order of the
*watched* operations of its actors, depth first, so no order is left to chance:

- each actor runs in its own thread on a proxy of one shared store (:meth:`Interleaving.proxy`); an operation on
  a watched key waits for its turn, and one actor at a time is let through, every other actor being parked at
  its next watched operation or finished;
- an operation on a key that is not watched runs at once. That is sound only if no other actor touches the key
  while one of them writes it (such operations commute with everything the others do); every run checks this,
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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional

import torch.distributed as dist

STEP_TIMEOUT_S = 10.0
"""How long an actor may run between two watched operations before the run counts as hung."""


class Killed(BaseException):
    """The actor was stopped before a store operation (a simulated SIGKILL)."""


class Hang(AssertionError):
    """An actor neither reached a watched operation nor finished within :data:`STEP_TIMEOUT_S`."""


@dataclass
class Interleaving:
    store: dist.Store
    watch: Callable[[str], bool]
    choices: list[int] = field(default_factory=list)
    """Which parked actor goes at each step (index into them, sorted by name); 0 past the end."""
    kill: dict[str, int] = field(default_factory=dict)
    trace: list[tuple[str, str, str]] = field(default_factory=list)
    """(actor, operation, key) of every watched operation, in the order they ran."""
    branching: list[int] = field(default_factory=list)
    """How many actors could go at each step."""
    chosen: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._proxies: dict[str, _Proxy] = {}
        self._parked: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._done: set[str] = set()
        self._turn: Optional[str] = None
        self._counts: dict[str, int] = {}
        self._touched: dict[str, dict[str, bool]] = {}  # unwatched key -> actor -> wrote it

    def proxy(self, actor: str) -> "_Proxy":
        if actor not in self._proxies:
            self._proxies[actor] = _Proxy(self.store, self, actor)
        return self._proxies[actor]

    def run(self, actors: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        """Run the actors to the end in the order ``choices`` picks; returns each one's result or exception."""
        results: dict[str, Any] = {}
        threads = []
        for name, fn in sorted(actors.items()):
            proxy = self.proxy(name)
            thread = threading.Thread(target=self._actor, args=(name, fn, proxy, results), daemon=True)
            threads.append(thread)
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
                ready = [a for a in parked if self._parked[a][0] != "wait"
                         or self.store.check(list(self._parked[a][1]))]
                options = ready or parked  # nothing else can move: a blocked wait runs into its timeout
                pick = self.choices[step] if step < len(self.choices) else 0
                self.branching.append(len(options))
                self.chosen.append(pick)
                actor = options[pick]
                op, keys = self._parked.pop(actor)
                self.trace.append((actor, op, keys[0] if len(keys) == 1 else ",".join(keys)))
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

    def _gate(self, actor: str, op: str, keys: tuple[str, ...]) -> None:
        with self._cond:
            self._parked[actor] = (op, keys)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._turn == actor, timeout=STEP_TIMEOUT_S * 2):
                raise Hang(f"{actor} never got its turn for {op} {keys}")
            self._turn = None
            n = self._counts.get(actor, 0)
            self._counts[actor] = n + 1
            if self.kill.get(actor) == n:
                raise Killed(f"{actor} killed before {op} {keys}")

    def _note(self, actor: str, keys: tuple[str, ...], writes: bool) -> None:
        with self._cond:
            for key in keys:
                by = self._touched.setdefault(key, {})
                by[actor] = by.get(actor, False) or writes

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

    def _call(self, op: str, keys: Iterable[str], writes: bool, fn: Callable[[], Any]) -> Any:
        keys = tuple(keys)
        if self.owner == threading.get_ident():
            if any(self._il.watch(k) for k in keys):
                self._il._gate(self.actor, op, keys)
            else:
                self._il._note(self.actor, keys, writes)
        return fn()

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


def hash_store(timeout_s: float = 0.5) -> dist.HashStore:
    """An in-memory store whose waits (``wait``, ``get`` of a missing key) end after ``timeout_s``."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def every_order(trial: Callable[[Interleaving], None], watch: Callable[[str], bool],
                kill: Optional[dict[str, int]] = None, limit: int = 20000) -> list[list[tuple[str, str, str]]]:
    """Run ``trial`` (which builds its case on ``il.store``/``il.proxy`` and calls ``il.run`` once) for every
    order of the watched operations; returns the trace of each run. A fresh store per run."""
    traces = []
    prefix: list[int] = []
    while True:
        il = Interleaving(hash_store(), watch, choices=prefix, kill=dict(kill or {}))
        trial(il)
        traces.append(il.trace)
        if len(traces) > limit:
            raise AssertionError(f"more than {limit} orders: watch fewer operations")
        for k in range(len(il.chosen) - 1, -1, -1):
            if il.chosen[k] + 1 < il.branching[k]:
                prefix = il.chosen[:k] + [il.chosen[k] + 1]
                break
        else:
            return traces
