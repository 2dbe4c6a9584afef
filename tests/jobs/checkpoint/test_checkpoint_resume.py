"""Save, resume, and the resumed iterations match an uninterrupted run."""

from __future__ import annotations

from tests.harness import assert_ok, layout_args, relative_difference, run_job
from tests.jobs.checkpoint.test_async_checkpoint import SYNC_ITERS, sync_saving_run


def test_resume_continues_the_run(tmp_path, jobs, tmp_path_factory):
    # Uninterrupted TP2 x DP2, saving at 3, 6 and 8 (the session's one such job, which the async-save test compares
    # its own checkpoints with); saving does not change training.
    full, ckpt = sync_saving_run(jobs, tmp_path_factory)
    assert_ok(full)
    assert (ckpt / "iter_0000003" / "metadata.json").is_file()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(SYNC_ITERS)
    assert [e["iteration"] for e in full.events("checkpoint_saved")] == [3, 6, SYNC_ITERS]

    resumed = run_job(tmp_path / "resumed", layout_args(2, 2, SYNC_ITERS) + [
        "--set", f"checkpoint.load={ckpt / 'iter_0000003'}"])
    assert_ok(resumed)
    before, after = full.losses(), resumed.losses()
    assert sorted(after) == list(range(4, SYNC_ITERS + 1)), "the resumed run must start at iteration 4"
    worst = max(relative_difference(before[i], after[i]) for i in after)
    assert worst <= 1e-6, f"worst relative loss difference after resume {worst:.2e}"
    # Not trivially equal: the loss keeps moving over the resumed iterations.
    assert len({round(after[i], 6) for i in after}) == len(after)
