"""``checkpoint.async_save``: Megatron-Core's async save path on CPU/gloo (NTP off).

- In one process: the forked writer writes the state as it was at the fork, whatever the trainer does to its
  tensors afterwards (and the fork is the snapshot point: a change before it is written).
- Real jobs: async saves write the same tensors as sync saves at the same iterations while training goes on;
  resuming from an async checkpoint continues the loss curve; a rank killed while an async save is pending
  leaves ``latest`` on the previous checkpoint, and the restarted job resumes from it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.harness import JobResult, assert_ok, layout_args, relative_difference, run_job, wait_until

WRITERS = 3
"""Processes an async save starts under a rank: the results-queue Manager, the writer, at least one worker."""


@pytest.fixture
def single_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port
    from ntp_megatron.patches import apply_patches

    apply_patches(cpu=True)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("mutate_before_fork", [False, True])
def test_async_writer_sees_the_state_at_the_fork(tmp_path, single_process_group, mutate_before_fork):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    original = torch.arange(1 << 20, dtype=torch.float32)
    live = original.clone()
    queue = AsyncCallsQueue()
    request = dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", live, replica_id=0)}, str(tmp_path),
                                      async_sharded_save=True)
    if mutate_before_fork:
        live.add_(1)  # the plan holds the live tensor itself (CPU: no copy), so this is written
    queue.schedule_async_request(request)  # forks the writer
    live.mul_(-1)  # training goes on: never written
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert (tmp_path / "metadata.json").is_file()
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty_like(live), replica_id=0)},
                                     str(tmp_path))["w"]
    assert torch.equal(loaded, original + 1 if mutate_before_fork else original)


def _tensors(path: Path) -> dict:
    """Every tensor of a torch_dist checkpoint, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


SAVES = ["--set", "checkpoint.save_interval=3"]
SYNC_ITERS = 8


def sync_saving_run(jobs, tmp_path_factory) -> tuple[JobResult, Path]:
    """TP2 x DP2 for SYNC_ITERS iterations, saving (synchronously) at 3, 6 and 8: the job and its checkpoint root.
    Run once per session: tests/jobs/checkpoint/test_checkpoint_resume.py resumes from the same checkpoints."""
    ckpt = tmp_path_factory.getbasetemp() / "sync-saving-run-ckpt"
    return jobs.run("sync-saving", layout_args(2, 2, SYNC_ITERS) + SAVES + ["--set", f"checkpoint.save={ckpt}"]), ckpt


def test_async_save_equals_sync_save_and_resumes(tmp_path, jobs, tmp_path_factory):
    iters = SYNC_ITERS
    async_ckpt = tmp_path / "async"
    sync, sync_ckpt = sync_saving_run(jobs, tmp_path_factory)
    assert_ok(sync)
    run = run_job(tmp_path / "async_run", layout_args(2, 2, iters) + SAVES + [
        "--set", f"checkpoint.save={async_ckpt}", "--set", "checkpoint.async_save=true"])
    assert_ok(run)
    saved = run.events("checkpoint_saved")
    assert [e["iteration"] for e in saved] == [3, 6, 8] and all(e["async"] for e in saved)
    assert (async_ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    # Saving in the background does not change training.
    assert run.losses() == sync.losses()
    # The async checkpoints hold the state of their iteration, although training went on while they were written.
    for iteration in (3, 6, 8):
        name = f"iter_{iteration:07d}"
        a, s = _tensors(async_ckpt / name), _tensors(sync_ckpt / name)
        assert a.keys() == s.keys() and any(k.startswith("optimizer.") for k in a)
        different = [k for k in a if not torch.equal(a[k], s[k])]
        assert not different, f"{name}: async and sync checkpoints differ in {different[:5]}"
        common_a = torch.load(async_ckpt / name / "common.pt", weights_only=False)
        common_s = torch.load(sync_ckpt / name / "common.pt", weights_only=False)
        assert common_a["iteration"] == common_s["iteration"] == iteration
        assert common_a["scheduler"] == common_s["scheduler"]
    # Resuming from an async checkpoint continues the uninterrupted curve.
    resumed = run_job(tmp_path / "resumed", layout_args(2, 2, iters) + [
        "--set", f"checkpoint.load={async_ckpt / 'iter_0000003'}"])
    assert_ok(resumed)
    before, after = sync.losses(), resumed.losses()
    assert sorted(after) == list(range(4, iters + 1))
    worst = max(relative_difference(before[i], after[i]) for i in after)
    assert worst <= 1e-5, f"worst relative loss difference after resuming from an async save {worst:.2e}"


def test_kill_with_an_async_save_pending_keeps_latest(tmp_path):
    """The save of iteration 4 is started after iteration 4; launch rank 1 dies at the start of iteration 5,
    before any rank can finalize it (finalization is collective, at the end of an iteration): ``latest`` stays
    at 2, and the restarted job goes on from 2 with the uninterrupted loss curve."""
    iters, ckpt = 6, tmp_path / "ckpt"
    base = layout_args(1, 2, iters) + ["--set", "checkpoint.save_interval=2", "--set", "checkpoint.async_save=true"]
    full = run_job(tmp_path / "full", base + ["--set", f"checkpoint.save={tmp_path / 'full_ckpt'}"])
    assert_ok(full)
    killed = run_job(tmp_path / "killed", base + ["--set", f"checkpoint.save={ckpt}",
                                                 "--inject-failure", "kill:rank=1,iter=5"])
    assert_ok(killed)
    assert "restarting all" in killed.stderr + killed.stdout
    iterations = [r["iteration"] for r in killed.records if r.get("kind") == "iteration"]
    # Iterations 3 and 4 ran twice: the restart resumed from iteration 2, not from the unfinished save of 4.
    assert sorted(set(iterations)) == list(range(1, iters + 1))
    assert iterations.count(3) >= 2 and iterations.count(4) >= 2, iterations
    assert [e["iteration"] for e in killed.events("checkpoint_saved")] == [2, 4, 6]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(iters)
    assert (ckpt / "iter_0000004" / "metadata.json").is_file()
    before, after = full.losses(), killed.losses()
    worst = max(relative_difference(before[i], after[i]) for i in before)
    assert worst <= 1e-5, f"worst relative loss difference after the restart {worst:.2e}"


def _rank_killed_during_an_async_save(path: str) -> None:
    """A one-rank job that starts an async save of 400 MB and, once its writer's workers have begun to write
    files, lists its descendants (the results-queue Manager, the writer, its workers), stops them (SIGSTOP: so
    that none can finish on its own) and is SIGKILLed."""
    import json
    import signal

    import psutil
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from ntp_megatron.patches import apply_patches

    apply_patches(cpu=True)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from ntp_megatron.training.checkpoint.save import _WriterDiesWithRank

    state = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.randn(25_000_000), replica_id=0)
             for i in range(4)}
    request = dist_checkpointing.save(state, path, async_sharded_save=True)
    AsyncCallsQueue().schedule_async_request(request._replace(async_fn=_WriterDiesWithRank(request.async_fn)))
    me = psutil.Process()

    def writing() -> bool:  # the writer and its workers exist and have begun to write the checkpoint's files
        return len(me.children(recursive=True)) >= WRITERS and any(Path(path).glob("*.distcp"))

    def armed(writer: psutil.Process) -> bool:
        """Each of the stopped writer's workers has a file of the checkpoint open (it is past its
        ``die_with_parent``) or has ended. A worker stopped a moment after its fork, before that, would stay
        stopped for good once orphaned — a state only this test's SIGSTOP makes: running, it would see its parent
        gone and exit."""
        try:  # stopped first: a signal is delivered some time after it is sent, and a fork can come in between
            return writer.status() == psutil.STATUS_STOPPED and all(w.status() == psutil.STATUS_ZOMBIE
                       or any(f.path.startswith(path + os.sep) for f in w.open_files()) for w in writer.children())
        except psutil.NoSuchProcess:  # one ended while we looked
            return False

    try:
        wait_until(writing, 60, "the async save's processes writing")
        writer = next(p for p in me.children() if p.children())
        writer.send_signal(signal.SIGSTOP)  # it forks no more workers
        wait_until(lambda: armed(writer), 60, "the writer's workers armed")
    except (AssertionError, StopIteration) as exc:  # said at once (the rank's exit would wait for its writer)
        Path(path + ".descendants").write_text(json.dumps(repr(exc)))
        os.kill(os.getpid(), signal.SIGKILL)
    descendants = {}
    for p in me.children(recursive=True):
        try:  # the start time tells a descendant from a later process given its pid (pids wrap at pid_max)
            descendants[p.pid] = (" ".join(p.cmdline())[:120], p.create_time())
            p.send_signal(signal.SIGSTOP)
        except psutil.NoSuchProcess:  # a short-lived one ended on its own
            descendants.pop(p.pid, None)
    Path(path + ".descendants").write_text(json.dumps(descendants))
    os.kill(os.getpid(), signal.SIGKILL)


def test_async_writers_die_with_their_rank(tmp_path):
    """Upstream's writer and worker processes outlive a killed rank (and could go on writing into a directory a
    restarted job rewrites); ours get SIGKILL with it."""
    import json
    import multiprocessing

    import psutil

    path = str(tmp_path / "ckpt")
    os.mkdir(path)
    rank = multiprocessing.get_context("fork").Process(target=_rank_killed_during_an_async_save, args=(path,))
    rank.start()
    rank.join(120)
    assert rank.exitcode == -9
    descendants = json.loads(Path(path + ".descendants").read_text())
    assert isinstance(descendants, dict) and len(descendants) >= WRITERS, descendants
    processes = []
    for pid, (_, started) in descendants.items():
        try:
            process = psutil.Process(int(pid))
            if process.create_time() == started:  # not a process started later with a reused pid
                processes.append(process)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=5)  # bounded: each must go within 5 s of the rank's death
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # upstream's (stopped) survivors: do not leave them behind
        p.kill()
    assert not alive, f"processes of the killed rank still there: {[(p.pid, descendants[str(p.pid)][0]) for p in alive]}"
