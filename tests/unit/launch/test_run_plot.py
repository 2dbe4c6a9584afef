"""The run plot's event labels: a failure and a rejoin a few iterations apart (the main job's: rank 3 killed in
iteration 15, replica 1 back at iteration 21 of 120) are drawn where they do not overlap, measured on the rendered
figure."""

from __future__ import annotations

import itertools

from ntp_megatron.launch import run_report


def _records(failed_at: int, rejoined_at: int, iterations: int = 120) -> list[dict]:
    records = [{"kind": "iteration", "iteration": i, "lm_loss": 5.0 - i / 40, "elapsed_ms": 100.0,
                "tp_per_replica": [2, 1 if failed_at <= i < rejoined_at else 2]} for i in range(1, iterations + 1)]
    records.append({"kind": "event", "event": "rank_failed", "launch_rank": 3, "iteration": failed_at})
    records.append({"kind": "event", "event": "reformed", "resume_iteration": rejoined_at, "joined": [[1, 1]]})
    return records


def _label_boxes(fig) -> list:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in fig.axes[0].texts]


def test_close_failure_and_rejoin_labels_do_not_overlap():
    for failed_at, rejoined_at in ((15, 21), (15, 15), (40, 44), (100, 104)):
        fig = run_report.figure(_records(failed_at, rejoined_at))
        boxes = _label_boxes(fig)
        assert len(boxes) == 2
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), (failed_at, rejoined_at, a, b)


def test_labels_far_apart_share_the_top_row():
    assert run_report.label_rows([(10, "rank 3 failed", "left"), (110, "replica 1 slot 1 rejoined", "right")],
                                 x_span=119) == [0, 0]
    # Close ones: the second goes one row down; a third clear of both goes back up.
    assert run_report.label_rows([(15, "rank 3 failed", "left"), (21, "replica 1 slot 1 rejoined", "right"),
                                  (90, "rank 2 failed", "left")], x_span=119) == [0, 1, 0]
