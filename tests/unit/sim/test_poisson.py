"""Poisson mode against closed forms derived from the failure process.

With warm start the process is stationary. A GPU (or a node, or a domain: one blast unit of w GPUs) is
down at a given moment iff one of the events on it in the preceding repair time is still being repaired;
events on a unit arrive at rate lambda*w, so by Poisson thinning the unit is down with probability
q_w = 1 - exp(-lambda * w * E[repair]), independently of every other unit.
"""

from __future__ import annotations

import json
from math import comb, exp, sqrt

import numpy as np
import pytest

from ntp_megatron.sim.calibration import StepTimeRatios
from ntp_megatron.sim.config import LLAMA3_RATE_PER_GPU_HOUR, load
from ntp_megatron.sim.failures import poisson_trace
from ntp_megatron.sim.layout import build_layout
from ntp_megatron.sim.report import to_json
from ntp_megatron.sim.run import simulate
from ntp_megatron.sim.strategies import build_strategies

from .sim_helpers import SMALL_CLUSTER, config, run_point, within

MEAN_REPAIR = 20.0
REPAIR = "failures.classes=[{name: hw, share: 1.0, repair_hours: [10, 30]}]"
FIXED = ("strategies.placement.dp_drop=fixed", "strategies.placement.ntp=fixed", "strategies.placement.ntp_boost=fixed")


def _stderr(stats: dict[str, float], trials: int) -> float:
    return stats["std"] / sqrt(trials)


def test_llama3_rate_reproduces_the_report():
    assert LLAMA3_RATE_PER_GPU_HOUR * 16384 * 54 * 24 == pytest.approx(419)


def test_failure_steps_arrive_at_the_poisson_rate():
    # an event fails a GPU iff that GPU is up when the event arrives (prob exp(-lambda E[D]), PASTA)
    cfg = config(*SMALL_CLUSTER, "failures.rate=mtbf", "failures.mtbf_hours=2000", REPAIR)
    layout = build_layout(cfg.cluster)
    lam, horizon, trials = 1 / 2000, 5000.0, 8
    counts = [
        int(poisson_trace(layout, cfg.failures, horizon, True, np.random.default_rng(s)).is_failure.sum())
        for s in range(trials)
    ]
    expected = lam * 512 * horizon * exp(-lam * MEAN_REPAIR)
    assert abs(np.mean(counts) - expected) < 4.5 * sqrt(expected / trials)


def _replica_speed(rate: np.ndarray, tp: int, pp: int, width: int, q: float) -> float:
    """E[rate[max over the pp groups of failed GPUs]] when a group's tp/width blast units fail i.i.d."""
    units = tp // width
    cdf_units = np.cumsum([comb(units, b) * q**b * (1 - q) ** (units - b) for b in range(units + 1)])
    cdf = np.array([cdf_units[k // width] for k in range(tp + 1)])  # P(K <= k), K = width * B
    pmf = np.diff(np.concatenate(([0.0], cdf**pp)))
    return float((rate * pmf).sum())


@pytest.mark.parametrize("blast, width", [("gpu", 1), ("node", 4), ("domain", 8)])
def test_stationary_capacity_of_dp_drop_ntp_and_boost(blast, width):
    mtbf, trials = 3000.0, 6
    overrides = (
        *SMALL_CLUSTER, "failures.rate=mtbf", f"failures.mtbf_hours={mtbf}", REPAIR,
        f"failures.blast_radius={blast}", "failures.node_size=4", "run.duration_days=100", f"run.trials={trials}",
        "strategies.enabled=[dp_drop, ntp, ntp_boost]", "strategies.boost.max_power=1.1", *FIXED,
    )  # fmt: skip
    p = run_point(*overrides)
    lam = 1 / mtbf
    q = 1 - exp(-lam * width * MEAN_REPAIR)
    rates = {s.name: s.table.rate for s in build_strategies(config(*overrides), StepTimeRatios())}
    # a replica is 16 GPUs; DP-drop keeps it iff none is down: exp(-lambda * 16 * E[D]) for any blast radius
    assert _replica_speed(rates["dp_drop"], 8, 2, width, q) == pytest.approx(exp(-lam * 16 * MEAN_REPAIR))
    for name, rate in rates.items():
        got = p.summaries[name]["goodput"]
        expected = _replica_speed(rate, 8, 2, width, q)
        assert within(got["mean"], expected, _stderr(got, trials)), (name, got["mean"], expected)
    if blast == "domain":  # a whole domain down is a whole TP group down: NTP can do nothing
        assert p.summaries["ntp"]["goodput"] == p.summaries["dp_drop"]["goodput"]


def test_checkpoint_restart_matches_the_renewal_formula():
    # The job runs on one 8-GPU domain, swapped for a healthy spare after each failure, so it is hit at
    # rate lambda = 1/h throughout. Work of a checkpoint interval T is lost on a failure, then a restart of
    # R (restarted by failures during it). Renewal-reward: goodput = lambda T e^{-lambda R} / (e^{lambda T} - 1)
    # (about 1 - lambda (T/2 + R) when lambda (T + R) << 1).
    trials = 6
    p = run_point(
        "cluster.gpus=40", "cluster.domain_size=8", "cluster.tp=8", "cluster.dp=1", "cluster.spare_domains=4",
        "failures.rate=mtbf", "failures.mtbf_hours=8", "failures.blast_radius=domain",
        "failures.classes=[{name: x, share: 1.0, repair_hours: [0.1, 0.1]}]",
        "checkpoint.interval_min=60", "checkpoint.restart_min=15", "run.duration_days=30", f"run.trials={trials}",
        "strategies.enabled=[checkpoint_restart]",
    )  # fmt: skip
    lam, T, R = 1.0, 1.0, 0.25
    expected = lam * T * exp(-lam * R) / (exp(lam * T) - 1)
    got = p.summaries["checkpoint_restart"]
    assert within(got["goodput"]["mean"], expected, _stderr(got["goodput"], trials) + 0.002)
    assert got["interruptions_per_day"]["mean"] == pytest.approx(24 * lam, rel=0.05)
    assert got["lost_capacity"]["max"] < 1e-3  # spares (almost) never ran out


def test_hot_spares_lose_nothing_while_spares_last_and_equal_dp_drop_without_spares():
    common = (*SMALL_CLUSTER, "failures.rate=mtbf", "failures.mtbf_hours=3000", REPAIR, "run.duration_days=30",
              "run.trials=3", "strategies.enabled=[dp_drop, hot_spares]", "strategies.placement.dp_drop=fixed")  # fmt: skip
    plenty = run_point(*common, "cluster.gpus=1024", "cluster.dp=32", "cluster.spare_domains=64")
    assert plenty.summaries["hot_spares"]["goodput"]["min"] == pytest.approx(1.0, abs=1e-12)
    assert plenty.summaries["dp_drop"]["goodput"]["max"] < 0.99
    none = run_point(*common)
    assert none.summaries["hot_spares"] == none.summaries["dp_drop"]


def test_fixed_minibatch_without_spares_runs_only_while_every_gpu_is_up():
    trials = 6
    p = run_point(
        *SMALL_CLUSTER, "failures.rate=mtbf", "failures.mtbf_hours=20000", REPAIR, "run.duration_days=100",
        f"run.trials={trials}", "strategies.batch_policy=fixed", "strategies.enabled=[dp_drop, ntp]",
    )  # fmt: skip
    expected = exp(-512 / 20000 * MEAN_REPAIR)  # P(no GPU of the job down)
    for name in ("dp_drop", "ntp"):
        got = p.summaries[name]["goodput"]
        assert within(got["mean"], expected, _stderr(got, trials)), (name, got["mean"], expected)


def test_fixed_minibatch_with_enough_spares_never_pauses():
    p = run_point(
        *SMALL_CLUSTER, "cluster.gpus=1024", "cluster.dp=32", "cluster.spare_domains=64", "failures.rate=mtbf",
        "failures.mtbf_hours=3000", REPAIR, "run.duration_days=30", "run.trials=2", "strategies.batch_policy=fixed",
    )  # fmt: skip
    for name in ("dp_drop", "hot_spares", "ntp", "ntp_boost"):
        assert p.summaries[name]["goodput"]["min"] == pytest.approx(1.0, abs=1e-12)
        assert 0 < p.summaries[name]["spares_needed_max"]["max"] <= 64


def test_losses_add_up_and_stay_in_range():
    p = run_point(
        "cluster.gpus=4096", "cluster.domain_size=32", "cluster.tp=32", "cluster.pp=4", "cluster.spare_domains=4",
        "failures.rate_multiplier=20", "strategies.reconfigure_s=120", "run.duration_days=5", "run.trials=2",
        "strategies.ntp.allowed_tp=[32, 30, 28]", "strategies.placement.dp_drop=fixed",  # hot spares' placement
    )  # fmt: skip
    for name, m in p.summaries.items():
        total = m["lost_capacity"]["mean"] + m["lost_pause"]["mean"] + m["lost_rollback"]["mean"]
        assert 1 - m["goodput"]["mean"] == pytest.approx(total, abs=1e-9), name
        assert 0 <= m["goodput"]["min"] <= m["throughput"]["max"] <= 1
    s = p.summaries
    assert s["checkpoint_restart"]["lost_rollback"]["mean"] > 0
    assert s["dp_drop"]["goodput"]["mean"] <= s["ntp"]["goodput"]["mean"] <= s["ntp_boost"]["goodput"]["mean"]
    assert s["dp_drop"]["goodput"]["mean"] <= s["hot_spares"]["goodput"]["mean"]
    series = p.series["ntp"]
    assert len(series["throughput_mean"]) == len(p.hours) == 300
    assert series["lost_work_mean"][-1] == pytest.approx((1 - s["ntp"]["goodput"]["mean"]) * 5 * 24)


def _json(*overrides: str) -> str:
    base, points = load(None, ["run.trials=2", "run.duration_days=3", "cluster.gpus=2048", *overrides])
    results, notes = simulate(points)
    data = to_json(base, results, notes)
    del data["elapsed_s"]  # wall time is the one thing a seed does not fix
    return json.dumps(data)


def test_deterministic_under_a_seed():
    assert _json("run.seed=7") == _json("run.seed=7")
    assert _json("run.seed=7") != _json("run.seed=8")


def test_packed_dp_drop_runs_every_full_replica_of_healthy_groups():
    # stationary, one GPU per event: groups are healthy independently w.p. p0 = exp(-lambda * 8 * E[D]), so packed
    # DP-drop runs E[floor(H / 2)] of 32 replicas with H ~ Binomial(64, p0); no pause (repack_pause_s = 0)
    trials, mtbf = 6, 1500.0
    p = run_point(
        *SMALL_CLUSTER, "failures.rate=mtbf", f"failures.mtbf_hours={mtbf}", REPAIR, "run.duration_days=100",
        f"run.trials={trials}", "strategies.enabled=[dp_drop]", "strategies.placement.dp_drop=packed",
        "strategies.repack_pause_s=0",
    )  # fmt: skip
    p0 = exp(-8 / mtbf * MEAN_REPAIR)
    expected = sum(comb(64, h) * p0**h * (1 - p0) ** (64 - h) * (h // 2) for h in range(65)) / 32
    got = p.summaries["dp_drop"]["goodput"]
    assert within(got["mean"], expected, _stderr(got, trials)), (got["mean"], expected)
    assert got["mean"] > exp(-16 / mtbf * MEAN_REPAIR)  # fixed placement's closed form: packing helps


def test_packed_strategies_pay_a_restart_per_interrupting_failure():
    common = (*SMALL_CLUSTER, "failures.rate=mtbf", "failures.mtbf_hours=3000", REPAIR, "run.duration_days=20",
              "run.trials=2", "strategies.enabled=[ntp]", "checkpoint.restart_min=6", "strategies.reconfigure_s=0")  # fmt: skip
    packed = run_point(*common, "strategies.placement.ntp=packed").summaries["ntp"]
    fixed = run_point(*common, "strategies.placement.ntp=fixed").summaries["ntp"]
    # each interruption, and each repair that lets the packed job run faster, pauses 0.1 h; pauses rarely overlap
    per_day = packed["interruptions_per_day"]["mean"] + packed["repacks_per_day"]["mean"]
    assert packed["repacks_per_day"]["mean"] > 0.3 * packed["interruptions_per_day"]["mean"]
    assert packed["lost_pause"]["mean"] == pytest.approx(per_day * 0.1 / 24, rel=0.05)
    assert fixed["lost_pause"]["max"] == 0.0 and fixed["repacks_per_day"]["max"] == 0.0


def test_a_packed_job_restarts_to_re_admit_every_repaired_group_it_can_use():
    # PP 1: a replica is one TP group. Stationary, one GPU per event: a TP group's down periods (busy periods of
    # an M/G/inf queue fed at lambda * tp) start at rate lambda * tp * exp(-lambda * tp * E[D]) and end as often.
    # Packed DP-drop runs every healthy group, so each end is a re-admission that only a restart can give (the
    # group rejoins as a replica of its own, other domains move), and each start interrupts the job.
    trials, mtbf, days = 6, 1500.0, 100
    p = run_point(
        "cluster.gpus=512", "cluster.domain_size=8", "cluster.tp=8", "cluster.pp=1", "failures.rate=mtbf",
        f"failures.mtbf_hours={mtbf}", REPAIR, f"run.duration_days={days}", f"run.trials={trials}",
        "strategies.enabled=[dp_drop, ntp]", "strategies.placement.dp_drop=packed",
        "strategies.placement.ntp=packed_on_restart", "strategies.repack_pause_s=0",
    )  # fmt: skip
    rate = 8 / mtbf
    per_day = 64 * rate * exp(-rate * MEAN_REPAIR) * 24
    stderr = sqrt(per_day / (days * trials))  # Poisson counts
    got = p.summaries["dp_drop"]
    assert within(got["repacks_per_day"]["mean"], per_day, stderr), (got["repacks_per_day"]["mean"], per_day)
    assert within(got["interruptions_per_day"]["mean"], per_day, stderr)
    assert p.summaries["ntp"]["repacks_per_day"]["max"] == 0.0  # repairs rejoin their replica in place


def test_planned_restarts_re_pack_and_cost_their_pause():
    # failures so rare that none happens: the only pauses are the planned restarts at 24, 48, ..., 216 h
    p = run_point(
        *SMALL_CLUSTER, "failures.rate=mtbf", "failures.mtbf_hours=1e12", "run.duration_days=10", "run.trials=1",
        "strategies.enabled=[dp_drop]", "strategies.restart_every_h=24", "strategies.repack_pause_s=360",
    )  # fmt: skip
    assert p.summaries["dp_drop"]["lost_pause"]["mean"] == pytest.approx(9 * 0.1 / 240)


def test_measured_recovery_replaces_the_reconfigure_pause(tmp_path):
    calib = tmp_path / "runtime.json"
    calib.write_text(json.dumps({"recovery_s": 90}))
    common = (*SMALL_CLUSTER, "failures.rate=mtbf", "failures.mtbf_hours=2000", REPAIR, "run.duration_days=10",
              "run.trials=2", "strategies.enabled=[dp_drop, ntp]")  # fmt: skip
    measured = run_point(*common, f"calibration={calib}", "strategies.reconfigure_s=5")
    configured = run_point(*common, "strategies.reconfigure_s=90")
    assert measured.summaries == configured.summaries
    assert measured.summaries["ntp"]["lost_pause"]["mean"] > 0


def test_spare_domains_are_healthy_as_often_as_the_failure_process_allows():
    # a spare domain of 8 GPUs is healthy w.p. exp(-lambda * 8 * E[D]); the job cannot use the others
    trials, mtbf = 4, 2000.0
    p = run_point(
        *SMALL_CLUSTER, "cluster.gpus=1024", "cluster.dp=32", "cluster.spare_domains=64", "failures.rate=mtbf",
        f"failures.mtbf_hours={mtbf}", REPAIR, "run.duration_days=60", f"run.trials={trials}",
        "strategies.enabled=[dp_drop]",
    )  # fmt: skip
    got = p.extra["healthy_spares"]
    assert within(got["mean"], 64 * exp(-8 / mtbf * MEAN_REPAIR), got["std"] / sqrt(trials))
    s = p.summaries["dp_drop"]
    assert s["spares_no_pause"]["min"] >= s["spares_needed_max"]["min"]
    assert s["spares_at_percentile"]["max"] <= s["spares_no_pause"]["max"]
