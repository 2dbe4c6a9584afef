"""The ntp-sim command: config errors as one line + exit 2, end-to-end outputs, import hygiene, the bench."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ntp_megatron.config.files import EXIT_CONFIG_ERROR, ConfigError
from ntp_megatron.sim import bench
from ntp_megatron.sim.cli import main
from ntp_megatron.sim.config import load

SMALL = ["--set", "cluster.gpus=1024", "--set", "run.trials=2", "--set", "run.duration_days=2", "--no-progress"]


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["run.trialz=3"], "unknown config key 'run.trialz'; allowed keys here: duration_days, trials"),
        (["cluster.tp=0"], "bad value for 'cluster.tp'"),
        (["strategies.enabled=[ntp, magic]"], "strategies.enabled.1"),
        (["strategies.batch_policy=grow"], "'shrink' or 'fixed'"),
        (["cluster.tp=12"], "cluster.tp=12 must divide cluster.domain_size=32"),
        (["cluster.gpus=1000"], "must be a multiple of cluster.domain_size"),
        (["cluster.spare_domains=1024"], "leaves no domain for the job"),
        (["cluster.dp=2000"], "cluster.dp=2000 needs"),
        (["failures.rate=mtbf"], "failures.mtbf_hours is required"),
        (["failures.classes=[{name: a, share: 0.5, repair_hours: [1, 2]}]"], "shares must add up to 1"),
        (["failures.classes=[{name: a, share: 1.0, repair_hours: [5, 2]}]"], "failures.classes.0.repair_hours"),
        (["strategies.ntp.allowed_tp=[32, 40]"], "strategies.ntp.allowed_tp"),
        (["strategies.boost.curve={kind: table, points: [[1, 1], [1.3, 0.9]]}"], "strategies.boost.curve.points"),
        (["sweep.key=cluster.tp"], "sweep: give either key and values, or points"),
        (["sweep.key=cluster.tp", "sweep.values=[32, 7]"], "sweep point 'tp=7': cluster.tp=7 must divide"),
        (["calibration=/nonexistent.json"], "calibration file not found"),
        (["strategies.placement.ntp=tight"], "'fixed', 'packed' or 'packed_on_restart'"),
        (["strategies.placement.magic=fixed"], "allowed keys here: checkpoint_restart, dp_drop"),
        (["strategies.degraded_speed.model=x"], "'integer_batch' or 'continuous'"),
        (["strategies.degraded_speed.local_batch=0"], "strategies.degraded_speed.local_batch"),
        (["strategies.restart_every_h=-1"], "strategies.restart_every_h"),
        (["run.spares_percentile=101"], "run.spares_percentile"),
        (["failures.rate_multiplier=.inf"], "bad value for 'failures.rate_multiplier': Input should be a finite number"),
        (["failures.fraction=.nan"], "bad value for 'failures.fraction'"),
        (["checkpoint.restart_min=.inf"], "bad value for 'checkpoint.restart_min'"),
        (["strategies.ntp.allowed_tp=[30, 28]"], "allowed_tp=[30, 28] must include the healthy cluster.tp=32"),
        (["strategies.boost.curve.kind=magic"], "expected tags: 'power_law', 'table'"),
        (["strategies.boost.curve.points=[[1, 0.9], [1.3, 1.2]]"], "must give performance 1 at power 1"),
        (["strategies.boost.curve.points=[[0.8, 0.9], [1.3, 1.2]]"], "must give performance 1 at power 1"),
    ],
)
def test_config_errors_are_one_line_and_exit_2(overrides, fragment, capsys, tmp_path):
    args = [a for o in overrides for a in ("--set", o)]
    assert main([*args, "--out", str(tmp_path), "--no-progress"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("ntp-sim: ") and "\n" not in err and "Traceback" not in err
    assert fragment in err


def test_a_curve_key_alone_picks_its_kind():
    base, _ = load(None, ["strategies.boost.curve.alpha=0.5"])
    assert base.strategies.boost.curve.kind == "power_law" and base.strategies.boost.curve.alpha == 0.5
    base, _ = load(None, ["strategies.boost.curve.points=[[1, 1], [1.2, 1.1]]"])
    assert base.strategies.boost.curve.kind == "table"


def test_missing_config_file_is_a_config_error(capsys):
    assert main(["/nonexistent/sim.yaml"]) == EXIT_CONFIG_ERROR
    assert "config file not found" in capsys.readouterr().err


def test_sweep_expands_to_one_config_per_point():
    _, points = load(None, ["sweep.key=failures.rate_multiplier", "sweep.values=[1, 2.5]"])
    assert [label for label, _ in points] == ["rate_multiplier=1", "rate_multiplier=2.5"]
    assert [cfg.failures.rate_multiplier for _, cfg in points] == [1.0, 2.5]
    assert all(cfg.sweep is None for _, cfg in points)


def test_run_writes_json_tables_and_plots(tmp_path, capsys):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(
        "title: tiny\nstrategies:\n  reconfigure_s: 30\nsweep:\n  key: failures.rate_multiplier\n  values: [1, 4]\n"
    )
    out = tmp_path / "out"
    assert main([str(cfg), *SMALL, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "| rate_multiplier=4 | NTP + power boost |" in stdout
    assert "ideal ratio" in stdout  # no calibration: the output says which ratios it used
    for name in ("results.json", "summary.md", "sweep.png", "timeseries_0.png", "timeseries_1.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    assert [p["label"] for p in data["points"]] == ["rate_multiplier=1", "rate_multiplier=4"]
    ntp = data["points"][1]["strategies"]["ntp"]
    assert set(ntp["summary"]) >= {"goodput", "lost_capacity", "spares_needed_max", "spares_no_pause"}
    assert len(ntp["series"]["goodput_mean"]) == len(data["points"][1]["hours"])


def test_snapshot_run_with_calibration(tmp_path, capsys):
    calib = tmp_path / "bench.json"
    calib.write_text(json.dumps({"degraded_step_time_ratio": {"32": {"31": 1.02}}}))
    args = [
        "--set",
        "failures.mode=snapshot",
        "--set",
        f"calibration={calib}",
        "--set",
        "run.trials=5",
        "--no-progress",
    ]
    assert main([*args, "--out", str(tmp_path / "o")]) == 0
    stdout = capsys.readouterr().out
    assert "snapshot mode has no time: skipped checkpoint_restart" in stdout
    assert f"step-time ratios from {calib}" in stdout and "no entry for TP" in stdout
    assert (tmp_path / "o" / "snapshot.png").exists()


def test_simulator_imports_neither_torch_nor_plotting():
    code = (
        "import sys, ntp_megatron.sim.cli, ntp_megatron.sim.run, ntp_megatron.sim.report;"
        "bad = [m for m in ('torch', 'megatron', 'matplotlib') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bench_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--trials", "1", "--days", "1", "--sizes", "1024,2048", "--repeat", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["gpus"] for r in rows] == [1024, 2048] and all(r["seconds"] > 0 for r in rows)
    assert all(r["strategies"] == 5 for r in rows)
    assert "| 2,048 |" in capsys.readouterr().out


def test_python_dash_m_cli_is_ntp_sim(tmp_path, capsys):
    args = [*SMALL, "--no-plots"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    direct = capsys.readouterr().out
    run = subprocess.run(
        [sys.executable, "-m", "ntp_megatron.sim.cli", *args, "--out", str(tmp_path / "b")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    strip = lambda text: [ln for ln in text.splitlines() if not ln.startswith(("wrote", "simulated in"))]  # noqa: E731
    assert strip(run.stdout) == strip(direct) and "| NTP |" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "ntp_megatron.sim.cli", "--set", "cluster.tp=12"], capture_output=True, text=True)
    assert bad.returncode == EXIT_CONFIG_ERROR and bad.stderr.startswith("ntp-sim: cluster.tp=12")


def test_config_error_class_is_shared():
    with pytest.raises(ConfigError):
        load(None, ["cluster.tp=12"])


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[3] / "configs" / "sim").glob("*.yaml")), ids=str)
def test_shipped_configs_load(path):
    base, points = load(path)
    assert base.title and len(points) >= 1


def test_planned_restarts_in_a_snapshot_change_nothing(tmp_path, capsys):
    # a snapshot has no time, so the job has only started: restart_every_h must not matter (it used to crash)
    config = Path(__file__).parents[3] / "configs" / "sim" / "study_c_llama3_spares.yaml"
    common = ["--set", "failures.mode=snapshot", "--set", "run.trials=3", "--set", "sweep=null", "--no-plots", "--no-progress"]
    assert main([str(config), *common, "--set", "strategies.restart_every_h=24", "--out", str(tmp_path / "a")]) == 0
    with_restarts = capsys.readouterr().out
    assert main([str(config), *common, "--out", str(tmp_path / "b")]) == 0
    strip = lambda text: [ln for ln in text.splitlines() if not ln.startswith(("wrote", "simulated in"))]  # noqa: E731
    assert strip(with_restarts) == strip(capsys.readouterr().out)
    assert main([str(config), "--set", "failures.mode=snapshot", "--set", "run.trials=2", "--no-plots", "--no-progress",
                 "--out", str(tmp_path / "c")]) == 0  # the shipped sweep, whose second point restarts daily
