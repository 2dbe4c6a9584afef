"""The order-forcing helper the protocol tests stand on (:mod:`tests.unit.elastic.interleavings`): it must reach every
outcome a race can have, with fewer runs than trying every order, and refuse a trial that hides a race."""

from __future__ import annotations

import pytest

from tests.unit.elastic.interleavings import Interleaving, Killed, every_order, hash_store


def _bump(store) -> None:
    store.set("x", str(int(store.get("x")) + 1))


@pytest.mark.parametrize("reduce", [True, False])
def test_a_lost_update_is_found(reduce):
    outcomes: set = set()

    def trial(il: Interleaving) -> None:
        il.store.set("x", "0")
        il.run({"a": lambda: _bump(il.proxy("a")), "b": lambda: _bump(il.proxy("b"))})
        outcomes.add(int(il.store.get("x")))

    orders = every_order(trial, lambda key: key == "x", reduce=reduce)
    assert outcomes == {1, 2}
    assert len(orders) == (4 if reduce else 6)  # 6 orders of 2 + 2 operations; 2 of them swap the two reads


def test_an_operation_that_commutes_first_still_lets_a_later_one_race():
    """A writes p; B writes q, then p. A's write and B's first one are independent, yet both orders of the two
    writes of p must be run (a reduction that only branches on the next operations would miss one)."""
    last_p: set = set()

    def trial(il: Interleaving) -> None:
        def a() -> None:
            il.proxy("a").set("p", "a")

        def b() -> None:
            il.proxy("b").set("q", "b")
            il.proxy("b").set("p", "b")

        il.run({"a": a, "b": b})
        last_p.add(il.store.get("p").decode())

    orders = every_order(trial, lambda key: True)
    assert last_p == {"a", "b"} and len(orders) == 2


def test_a_wait_runs_after_the_write_it_waits_for_or_times_out():
    def trial(il: Interleaving) -> None:
        def waiter() -> str:
            il.proxy("waiter").wait(["k"])
            return il.proxy("waiter").get("k").decode()

        results = il.run({"waiter": waiter, "writer": lambda: il.proxy("writer").set("k", "v")})
        assert results["waiter"] == "v"

    assert len(every_order(trial, lambda key: True)) == 1

    il = Interleaving(hash_store(0.1), lambda key: True)
    result = il.run({"waiter": lambda: il.proxy("waiter").wait(["never"])})["waiter"]
    assert "timeout" in str(result).lower(), result


def test_a_killed_actor_stops_before_its_operation():
    il = Interleaving(hash_store(), lambda key: True, kill={"a": 1})
    result = il.run({"a": lambda: [il.proxy("a").set("x", "1"), il.proxy("a").set("y", "1")]})["a"]
    assert isinstance(result, Killed)
    assert il.store.check(["x"]) and not il.store.check(["y"])


def test_a_race_on_an_unwatched_key_is_refused():
    def trial(il: Interleaving) -> None:
        il.run({"a": lambda: _bump(il.proxy("a")), "b": lambda: _bump(il.proxy("b"))})

    def start(il: Interleaving) -> None:
        il.store.set("x", "0")
        trial(il)

    with pytest.raises(AssertionError, match="unwatched key 'x' is shared"):
        every_order(start, lambda key: False)
