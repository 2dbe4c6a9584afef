"""``scripts/bench.sh`` runs to the end: every part of the benchmark once at its smallest size (``--smoke``), its
table and its JSON. A test of the harness, not a measurement: no figure is compared with another."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence


from ntp_megatron.bench import cli, control_plane, init_weights, memory as memory_part, step_time
from ntp_megatron.bench.sizes import SMOKE
from tests.harness import check_reformations, read_records, run_module


def _from_the_zygote(module: str, args: Sequence[str], out_dir: Path) -> tuple[int, str, str]:
    """Each job and probe forked from the test zygote (no imports to pay); a job's re-formations are checked
    like every other job's."""
    code, err = run_module(module, list(args), out_dir)
    if module == "ntp_megatron.launch.launcher" and code == 0:
        run_dir = Path(args[args.index("--run-dir") + 1])
        check_reformations(read_records(Path(args[args.index("--metrics-file") + 1])), run_dir)
    return code, (out_dir / f"{module}.stdout").read_text(), err


def test_every_part_of_the_benchmark_runs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(["--smoke", "--out", str(out)], run=_from_the_zygote) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["smoke"]
    assert set(result["cases"]) == {c.name for c in step_time.CASES}
    assert all(c["samples"] == SMOKE.iters - SMOKE.warmup for c in result["cases"].values())
    assert [r["comparison"] for r in result["ratios"]] == [label for label, *_ in step_time.RATIOS]
    assert [r["tp_rank"] for r in result["communication"]["ranks"]] == list(range(SMOKE.comm_tp))
    failures = result["failure_recovery"]
    assert set(failures["median"]) == {"ntp", "restart from checkpoint"}
    assert failures["moved_over_lower_bound"] == 1.0
    assert failures["median"]["restart from checkpoint"]["iterations_rolled_back"] >= 0
    assert set(result["init"]["cases"]) == {f"{init} tp{tp}" for tp in SMOKE.init_tps
                                            for init in init_weights.INIT_KINDS}
    assert set(result["checkpoint_stall"]["cases"]) == {"no saves", "sync saves", "async saves"}
    memory = result["memory"]
    assert set(memory["cases"]) == set(memory_part.memory_cases(SMOKE))
    assert all(c["ranks"] == SMOKE.memory_tp * SMOKE.memory_dp for c in memory["cases"].values())
    assert all(c["planned_equal"] for name, c in memory["cases"].items() if name.startswith("ntp"))
    assert len(memory["ratios"]) == 4 * len(SMOKE.memory_instances)
    [reformations] = memory["reform"].values()  # from the failure part's NTP job: its proxy and healthy ranks
    assert {r["role"] for r in reformations} == {"proxy", "healthy"}
    recovery = result["recovery"]
    assert [(r["layout"], r["design"]) for r in recovery["rows"]] == [
        (f"TP{tp} x DP2", d) for tp in SMOKE.recovery_tps for d in step_time.RECOVERY_DESIGNS]
    by_design = {r["design"]: r for r in recovery["rows"]}
    # Every group made anew, or each survivor keeps itself alone and the healthy replica's ranks their TP group too
    # (TP2 x DP2, one rank killed: 3 survivors, 2 of them healthy): the switch reaches the ranks.
    assert by_design["rebuild_all"]["groups_kept"] == 0 and by_design["keep_untouched"]["groups_kept"] == 3 + 2
    control = result["control_plane"]
    assert [(r["design"], r["ranks"]) for r in control] == [
        (d, n) for d in ("two_level", "current") for n in SMOKE.control_plane_ranks]
    for row in control:  # every simulated rank voted every iteration and learned the failure's generation
        assert row["false_fences"] == 0 and row["relay_errors"] == [] and row["ranks_failed"] == 0, row
        real = row["ranks"] if row["design"] == "current" else 8 * min(control_plane.WORKERS, row["nodes"])
        assert row["votes_timed"] == real * SMOKE.control_plane_iters, row
        assert row["failure_to_generation_s"] is not None and row["generation_bytes_per_rank"] > 0, row
        assert row["survivors_noted_s"] is not None, row  # the controller's report saw every survivor's note
    for heading in ("| case | ranks | median step (ms) |", "| comparison | ratio | note |",
                    "Per iteration, replica 0 (healthy)", "A failure, same job", "Recovery, groups made anew",
                    "Building one rank's model", "Control plane, one store against two levels",
                    "Checkpoint stall, sync against async save", "Training state per rank", "Re-forming ranks' peaks",
                    f"wrote {out}"):
        assert heading in printed, heading
