"""The paper-figure configs as shipped, at the paper's points: pins the numbers docs/simulator.md reports.

Each run uses the config's own trials and seed, so these are the figures of docs/simulator.md exactly. Where the
paper is matched (DP-drop and NTP + power boost, in both figures) the test also checks them within +-10 % of the
paper's; NTP is not matched, and docs/simulator.md gives the numbered account of why (assumption 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ntp_megatron.sim.config import load
from ntp_megatron.sim.run import simulate

CONFIGS = Path(__file__).parents[3] / "configs" / "sim"


def _summaries(name: str, *overrides: str):
    _, points = load(CONFIGS / name, ["sweep=null", *overrides])
    results, _ = simulate(points)
    return results[0].summaries


def test_fig6_at_0_4_percent_failed():
    s = _summaries("paper_fig6.yaml", "failures.fraction=0.004")
    loss = {k: 100 * s[k]["throughput_loss"]["mean"] for k in ("dp_drop", "ntp", "ntp_boost")}
    assert loss == pytest.approx({"dp_drop": 12.39, "ntp": 0.79, "ntp_boost": 0.0}, abs=0.005)
    assert abs(loss["dp_drop"] - 12) <= 1.2 and loss["ntp_boost"] < 1  # paper: about 12 %, under 1 %
    assert loss["ntp"] < 0.9 * 3  # paper: about 3 %; not matched (docs/simulator.md, assumption 1)


def test_fig7_spares_that_never_pause_at_llama3_rates():
    s = _summaries("paper_fig7.yaml", "failures.rate_multiplier=1.0")
    never = {k: s[k]["spares_no_pause"]["max"] for k in ("dp_drop", "ntp", "ntp_boost")}
    assert never == {"dp_drop": 95, "ntp": 12, "ntp_boost": 0}
    assert abs(never["dp_drop"] - 90) <= 9 and never["ntp_boost"] == 0  # paper: 90 and 0
    assert never["ntp"] < 0.9 * 16  # paper: 16; not matched (docs/simulator.md, assumption 1)
    peak = {k: s[k]["spares_needed_max"]["max"] for k in ("dp_drop", "ntp", "ntp_boost")}
    assert peak == {"dp_drop": 86, "ntp": 8, "ntp_boost": 0}  # with spares that never fail
