"""Save at iteration 10, resume, and iterations 11–20 match an uninterrupted run."""

from __future__ import annotations

from tests.harness import assert_ok, layout_args, relative_difference, run_job


def test_resume_continues_the_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Uninterrupted 20 iterations; saving at 10 and 20 does not change training.
    full = run_job(tmp_path / "full", layout_args(2, 2, 20) + [
        "--set", f"checkpoint.save={ckpt}", "--set", "checkpoint.save_interval=10"])
    assert_ok(full)
    assert (ckpt / "iter_0000010" / "metadata.json").is_file()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert [e["iteration"] for e in full.events("checkpoint_saved")] == [10, 20]

    resumed = run_job(tmp_path / "resumed", layout_args(2, 2, 20) + [
        "--set", f"checkpoint.load={ckpt / 'iter_0000010'}"])
    assert_ok(resumed)
    before, after = full.losses(), resumed.losses()
    assert sorted(after) == list(range(11, 21)), "the resumed run must start at iteration 11"
    worst = max(relative_difference(before[i], after[i]) for i in after)
    assert worst <= 1e-6, f"worst relative loss difference after resume {worst:.2e}"
    # Not trivially equal: the loss keeps moving over the resumed iterations.
    assert len({round(after[i], 6) for i in after}) == len(after)
