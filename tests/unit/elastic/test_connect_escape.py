"""The connect escape (patches/torch_distributed_c10d.py): a gloo group's construction runs in a helper thread, waited
for in slices; the ``connect`` phase point is reached after the first; once the generation is over the wait is given
up, and the helper is handed to the escape (its groups held until it ends). Upstream's constructor is a stand-in that
blocks until released: milliseconds. The real gloo hole is tests/jobs/live/test_wait_escape.py's."""

from __future__ import annotations

import threading
import time

import pytest

from ntp_megatron import phases
from ntp_megatron.patches import torch_distributed_c10d as c10d_patch
from ntp_megatron.patches.torch_distributed_work import CollectiveAbandoned


class Escape:
    def __init__(self) -> None:
        self.ended = False
        self.waits: list = []

    def over(self) -> bool:
        return self.ended

    def reason(self):
        return "generation 4 ended" if self.ended else None

    def abandoned(self, wait) -> None:
        self.waits.append(wait)


@pytest.fixture
def upstream(monkeypatch):
    """Upstream's constructor: blocks until ``release`` is set, then raises ``error`` if one is set."""

    class Upstream:
        release = threading.Event()
        error = None

        def __init__(self, store, rank, size) -> None:
            assert Upstream.release.wait(10.0)
            if Upstream.error is not None:
                raise Upstream.error
            self.made = (store, rank, size)

    monkeypatch.setattr(c10d_patch, "_UpstreamGloo", Upstream)
    yield Upstream
    Upstream.release.set()
    phases.install(None)


def test_a_connect_waits_in_slices_reaches_its_point_once_and_keeps_the_phase(upstream):
    group, points = object.__new__(upstream), []
    phases.enter("reform")
    threading.Timer(3 * c10d_patch.torch_distributed_work.SLICE.total_seconds(), upstream.release.set).start()
    c10d_patch._connect(group, ("store", 1, 4), {}, Escape(), points.append)
    assert group.made == ("store", 1, 4)
    assert points == [c10d_patch.CONNECT_POINT]  # once, however many slices
    assert phases.current()[1] == "reform"


def test_a_connect_is_given_up_once_its_generation_is_over(upstream):
    escape = Escape()
    threading.Timer(0.1, lambda: setattr(escape, "ended", True)).start()
    start = time.monotonic()
    with pytest.raises(CollectiveAbandoned, match="gloo's connect of a process group given up: generation 4 ended"):
        c10d_patch._connect(object.__new__(upstream), ("store", 0, 2), {}, escape, lambda phase: None)
    assert time.monotonic() - start < 1.0
    [wait] = escape.waits
    assert wait.what == "gloo's connect of a process group" and not wait.finished()  # held while the helper runs
    upstream.release.set()
    wait.helper.join(5.0)
    assert wait.finished()


def test_upstreams_own_error_reaches_the_caller(upstream):
    upstream.error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    upstream.release.set()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        c10d_patch._connect(object.__new__(upstream), ("store", 0, 2), {}, Escape(), lambda phase: None)
    upstream.error = None
