"""How long a rank still waits on a collective of an ended generation (:func:`ntp_megatron.elastic.watchdog.escape_grace`).

The rule: a rank of a replica the end named no dead member of waits ``replica_grace_s`` while it computes (its waits
there are on its own replica's groups, whose members arrive); everywhere else, and whenever the dead are unknown,
``escape_grace_s``.
"""

from __future__ import annotations

import pytest

from ntp_megatron.config import timing
from ntp_megatron.elastic.watchdog import escape_grace

pytestmark = pytest.mark.unit

SHORT, LONG = timing.current().escape_grace_s, timing.current().replica_grace_s


def test_the_two_graces_differ():
    assert LONG > SHORT


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_whole_replica_computing_waits_for_its_peers(phase):
    assert escape_grace(phase, 0, {(1, 0), (1, 1, 0)}) == LONG


@pytest.mark.parametrize("phase", ["grad_sync", "optimizer", "param_gather", "reform", "start", "checkpoint"])
def test_outside_compute_the_short_grace(phase):
    """There a rank waits on groups across replicas, whose other members may have left."""
    assert escape_grace(phase, 0, {(1, 0)}) == SHORT


def test_a_replica_with_a_dead_member_gets_the_short_grace():
    assert escape_grace("backward", 1, {(1, 0, 1)}) == SHORT


def test_unknown_dead_or_replica_gets_the_short_grace():
    assert escape_grace("backward", 0, None) == SHORT
    assert escape_grace("backward", None, {(1, 0)}) == SHORT


def test_a_planned_move_names_no_dead():
    assert escape_grace("forward", 0, set()) == LONG
