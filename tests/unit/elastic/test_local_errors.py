"""A rank's own error versus a peer's failure (ntp_megatron.elastic.errors), and the controller's answer to a death
whose rank reported an error of its own: the job stops naming it, with no new generation. Over a HashStore, in one
process."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ntp_megatron import faults, phases
from ntp_megatron.config import timing
from ntp_megatron.elastic import commit, errors, keys, publication
from ntp_megatron.elastic.commit import IterationAborted, note_aware
from ntp_megatron.elastic.controller import Controller, Death
from ntp_megatron.plan.layout import make_topology
from ntp_megatron.plan.stages import JobTopology
from ntp_megatron.training.checkpoint import CheckpointError

UNITS = {"heads": 4, "ffn": 8, "vocab": 8}
GRACE_S = 0.3


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(timing, "_current", timing.current().model_copy(update={"peer_grace_s": GRACE_S}))
    yield
    phases.install(None)


def marked_over(store: dist.Store, generation: int):
    """What ElasticRank.marked_over does, on a bare store."""
    def check(within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while not store.check([keys.abort(generation)]) and not store.check([keys.STOP]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    return check


@pytest.mark.parametrize("exc", [
    dist.DistNetworkError("Socket Timeout"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"),
    IterationAborted("iteration 4 aborted by the controller"),
    errors.GenerationEnded("forming generation 2 did not complete"),
])
def test_transport_errors_and_verdicts_are_a_peers_failure_at_once(exc):
    store = dist.HashStore()
    start = time.monotonic()
    assert errors.caused_by_peer(exc, marked_over(store, 0))
    assert time.monotonic() - start < GRACE_S / 2  # no wait for the generation's end


@pytest.mark.parametrize("exc", [
    FileExistsError(17, "File exists", "/ckpt"), KeyError("bug"), faults.InjectedError("injected error"),
    # A rank's own CUDA / NCCL failure and a store wait of ours that timed out: torch.distributed errors, not a
    # peer's death (unless the generation ends).
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error"),
    dist.DistStoreError("wait timeout after 60000ms, keys: /elastic/gen1/ready"),
    # gloo's own timeouts, although their text names gloo's transport: a hung peer, or this rank's own lateness.
    RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                 "60000ms for recv operation to complete"),
    dist.DistBackendError("[../third_party/gloo/gloo/transport/tcp/pair.h:311] Connect timeout [127.0.0.1]:41235"),
    RuntimeError("Application timeout caused pair closure"),
])
def test_any_other_exception_is_own_unless_the_generation_ends_within_the_grace(exc):
    store = dist.HashStore()
    start = time.monotonic()
    assert not errors.caused_by_peer(exc, marked_over(store, 3))
    assert GRACE_S <= time.monotonic() - start < GRACE_S + 1.0  # bounded
    # The same exception while the controller marks the generation over (a peer's death behind it): a peer's.
    timer = threading.Timer(GRACE_S / 3, lambda: store.set(keys.abort(3), "1"))
    timer.start()
    try:
        assert errors.caused_by_peer(exc, marked_over(store, 3))
    finally:
        timer.join()
    assert not errors.caused_by_peer(exc, marked_over(store, 4))  # another generation's end says nothing


def test_with_ntp_off_a_gloo_timeout_still_echoes_a_peer():
    """NTP off names the rank behind its peers' failures: a hung rank's peers time out, and they are its echoes."""
    timeout = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 600ms "
                           "for recv operation to complete")
    assert errors.is_peer_failure(timeout) and not errors.is_transport_failure(timeout)
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1")
    assert errors.is_peer_failure(closed) and errors.is_transport_failure(closed)


def test_an_error_of_ours_is_own_at_once_whatever_it_quotes():
    """A save whose write broke a pipe is this rank's failed save, not a transport error; no grace either."""
    exc = CheckpointError("saving the checkpoint of iteration 3 to /ckpt: this rank's write failed: BrokenPipeError: "
                          "[Errno 32] Broken pipe")
    store = dist.HashStore()
    store.set(keys.abort(3), "1")  # even while the generation ends
    start = time.monotonic()
    assert not errors.is_peer_failure(exc) and not errors.caused_by_peer(exc, marked_over(store, 3))
    assert time.monotonic() - start < GRACE_S / 2


def test_out_of_memory_is_own_at_once_and_says_so_in_the_report(capsys):
    """No grace: the peers blocked in a collective with this rank wait for the controller's verdict, which comes
    once this rank has exited; the report tells the controller it ran out of memory."""
    store = dist.HashStore()
    for exc in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), MemoryError()):
        start = time.monotonic()
        assert not errors.caused_by_peer(exc, marked_over(store, 3))
        assert time.monotonic() - start < GRACE_S / 2
    phases.at_iteration(4)
    phases.enter("reform")
    errors.report(store, 1, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    record = json.loads(store.get(keys.rank_error(1)))
    assert record["out_of_memory"] and (record["iteration"], record["phase"]) == (4, "reform")
    assert "Traceback" not in capsys.readouterr().err  # a condition of the machine
    errors.report(store, 2, ValueError("a bug"))
    assert not json.loads(store.get(keys.rank_error(2)))["out_of_memory"]


def test_an_injected_out_of_memory_error_raises_torchs_at_its_phase():
    spec = faults.parse_failure_spec("oom:rank=0,iter=2,phase=reform", world_size=4, train_iters=5)
    assert str(spec) == "oom:rank=0,iter=2,phase=reform"
    faults.install(faults.FailureTrigger(0, [spec]))
    phases.at_iteration(2)
    with pytest.raises(torch.OutOfMemoryError, match=r"oom:rank=0,iter=2,phase=reform"):
        phases.point("reform")


def test_the_report_names_the_error_where_it_happened(capsys):
    store = dist.HashStore()
    phases.at_iteration(7)
    phases.enter("checkpoint")
    code = errors.report(store, 2, PermissionError(13, "Permission denied", "/ckpt/iter_0000007"))
    assert code != 0
    record = json.loads(store.get(keys.rank_error(2)))
    assert record["error"] == "PermissionError: [Errno 13] Permission denied: '/ckpt/iter_0000007'"
    assert (record["iteration"], record["phase"]) == (7, "checkpoint") and record["time"] > 0
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [  # a condition of the machine: one line, no traceback
        "error: launch rank 2, iteration 7, phase checkpoint: " + record["error"]]
    assert errors.reported_error(store, 2) == record and errors.reported_error(store, 1) is None


def test_a_bug_is_reported_with_its_traceback(capsys):
    try:
        {}["missing"]
    except KeyError as exc:
        errors.report(None, 0, exc)
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].endswith("KeyError: 'missing'")


def test_an_injected_error_raises_at_its_phase_and_iteration():
    spec = faults.parse_failure_spec("error:rank=1,iter=3,phase=optimizer", world_size=4, train_iters=5)
    assert str(spec) == "error:rank=1,iter=3,phase=optimizer"
    fired = []
    faults.install(faults.FailureTrigger(1, [spec], on_fire=fired.append))
    for k in (1, 2, 3):
        phases.at_iteration(k)
        for phase in ("start", "forward", "backward", "grad_sync"):
            phases.point(phase)
    assert fired == []
    with pytest.raises(faults.InjectedError, match=r"error:rank=1,iter=3,phase=optimizer"):
        phases.point("optimizer")
    assert fired == [spec] and phases.current() == (3, "optimizer")
    phases.point("optimizer")  # fires once


def controller(store: dist.Store, emit=lambda record: None) -> Controller:
    return Controller(store, JobTopology.one_stage(make_topology(2, 2, UNITS)), min_tp=1, policy="drop_replica",
                      say=lambda line: None, emit=emit)


def test_a_death_with_a_reported_error_stops_the_job_naming_it():
    store = dist.HashStore()
    records: list[dict] = []
    ctl = controller(store, emit=records.append)
    store.set(commit.COMPLETED, "0")
    phases.at_iteration(30)
    phases.enter("checkpoint")
    errors.report(store, 0, FileExistsError(17, "File exists", "/runs/ckpt"))
    reason = ctl.handle([Death(0, time.time(), "exited with code 1")])
    assert reason is not None and "launch rank 0" in reason and "/runs/ckpt" in reason and "checkpoint" in reason
    assert store.get(keys.STOP).decode() == reason
    assert store.check([keys.abort(0)])  # every rank's watchdog gets it out of its collectives now
    assert store.get(publication.LATEST).decode() == "0"  # no generation re-formed around the error
    # ... and it is no failure of a rank (docs/metrics.md): the job_stopped event names it, where it happened
    assert not [r for r in records if r.get("event") == "rank_failed"]
    assert (ctl.error_stop["launch_rank"], ctl.error_stop["iteration"], ctl.error_stop["phase"]) == (0, 30, "checkpoint")


def test_the_stop_names_the_error_a_rank_only_echoed():
    """A failed checkpoint write reaches every rank of the save; only the rank that gathered the results knows
    the cause, the others raise an echo. Whatever the order of the deaths, the reason names the cause."""
    store = dist.HashStore()
    ctl = controller(store)
    store.set(commit.COMPLETED, "0")
    echo = CheckpointError("saving the checkpoint of iteration 3 to /ckpt: a write failed on another rank")
    echo.echo = True
    errors.report(store, 0, echo)
    errors.report(store, 2, CheckpointError("saving the checkpoint of iteration 3 to /ckpt: a write failed "
                                            "(rank 1 of the saving group): OSError: No space left on device"))
    reason = ctl.handle([Death(0, time.time(), "exited with code 1"), Death(2, time.time(), "exited with code 1")])
    assert reason is not None and "launch rank 2" in reason and "No space left on device" in reason


def _raised_in_a_wait(exc: BaseException) -> BaseException:
    try:
        with phases.waiting():
            raise exc
    except BaseException as raised:  # noqa: BLE001
        return raised


def test_a_rank_that_gave_up_waiting_on_its_peers_is_not_reported_as_failing_with_an_error_of_its_own(capsys):
    """No generation came after its collective timed out (a peer stuck with its heartbeat alive and the fence off):
    the rank, a victim, says it gave up waiting; the stop says so too, and names a rank's real error before it. An
    error of ours or of the machine raised inside a wait is still the rank's own."""
    store = dist.HashStore()
    ctl = controller(store)
    store.set(commit.COMPLETED, "0")
    phases.at_iteration(4)
    phases.enter("forward")
    timeout = _raised_in_a_wait(TimeoutError("no generation after 0 within 60 s; this rank had left its generation "
                                             "after RuntimeError: Timed out waiting 60000ms for recv"))
    assert errors.waited_on_peers(timeout) and not errors.waited_on_peers(TimeoutError("a store wait of ours"))
    assert not errors.waited_on_peers(_raised_in_a_wait(errors.OwnError("a write failed")))
    assert not errors.waited_on_peers(_raised_in_a_wait(torch.OutOfMemoryError("out of memory")))
    assert not errors.waited_on_peers(_raised_in_a_wait(RuntimeError("NCCL error: unhandled cuda error")))
    errors.report(store, 3, timeout)
    assert "gave up waiting on its peers: launch rank 3, iteration 4, phase forward: TimeoutError" in \
        capsys.readouterr().err
    reason = ctl.handle([Death(3, time.time(), "exited with code 1")])
    assert reason.startswith("launch rank 3 gave up waiting on its peers (iteration 4, phase forward): TimeoutError")
    assert "error of its own" not in reason
    store = dist.HashStore()
    ctl = controller(store)
    store.set(commit.COMPLETED, "0")
    errors.report(store, 3, timeout)
    errors.report(store, 1, ValueError("a bug"))
    reason = ctl.handle([Death(3, time.time(), "exited with code 1"), Death(1, time.time(), "exited with code 1")])
    assert reason.startswith("launch rank 1 failed with an error of its own"), reason


def test_an_echo_that_dies_first_waits_for_the_report_of_the_cause():
    """The echo's rank exits alone, the rank with the cause reports a moment later (still alive when the
    controller acts): the stop names the cause, and it is the one failure recorded."""
    store = dist.HashStore()
    records: list[dict] = []
    ctl = controller(store, emit=records.append)
    store.set(commit.COMPLETED, "0")
    echo = CheckpointError("saving the checkpoint of iteration 3 to /ckpt: another rank of the saving group failed")
    echo.echo = True
    errors.report(store, 0, echo)
    cause = CheckpointError("saving the checkpoint of iteration 3 to /ckpt: this rank's write failed: OSError: "
                            "[Errno 28] No space left on device")
    timer = threading.Timer(0.3, lambda: errors.report(store, 3, cause))
    timer.start()
    try:
        reason = ctl.handle([Death(0, time.time(), "exited with code 1")])
    finally:
        timer.join()
    assert reason is not None and "launch rank 3" in reason and "No space left on device" in reason, reason
    assert ctl.error_stop["launch_rank"] == 3 and not [r for r in records if r.get("event") == "rank_failed"]


def test_a_death_without_a_report_is_re_formed_around():
    store = dist.HashStore()
    ctl = controller(store)
    store.set(commit.COMPLETED, "0")
    assert ctl.handle([Death(3, time.time(), "was killed by signal SIGKILL")]) is None
    assert store.get(publication.LATEST).decode() == "1" and not store.check([keys.STOP])
    for survivor in (0, 1, 2):  # they noticed, so the failure's report does not wait for them
        note_aware(store, 0, survivor, time.time())
    ctl.close()
