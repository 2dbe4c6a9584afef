"""Power boost, the pure parts and the NVML path over a fake NVML: the power a rank's load needs on the curve, capped;
setting and restoring the device's limit in milliwatts within its range; a refusal or a missing NVML is a dry run
that says why."""

from __future__ import annotations

import sys
import types

import pytest

from ntp_megatron.plan import power_curve
from ntp_megatron.speed import power
from ntp_megatron.config.schema import JobConfig

pytestmark = pytest.mark.unit


def test_a_tp3_survivor_of_tp4_needs_four_thirds_performance():
    boost = power_curve.boost_model(max_power=2.0, alpha=0.5, points=None)
    chosen = power_curve.plan(boost, share=1 / 3, tp_base=4)
    assert chosen.load == pytest.approx(4 / 3)
    assert chosen.power == pytest.approx((4 / 3) ** 2) and chosen.perf == pytest.approx(4 / 3) and not chosen.short
    healthy = power_curve.plan(boost, share=1 / 4, tp_base=4)
    assert (healthy.power, healthy.perf) == (1.0, 1.0)


def test_the_cap_leaves_a_rank_short_and_says_so():
    boost = power_curve.boost_model(max_power=1.3, alpha=0.58, points=None)  # the simulator's defaults
    chosen = power_curve.plan(boost, share=1 / 3, tp_base=4)
    assert chosen.power == 1.3 and chosen.perf == pytest.approx(1.3 ** 0.58) and chosen.short


def test_a_slow_rank_of_a_rebalanced_replica_needs_its_share_over_its_speed():
    boost = power_curve.boost_model(max_power=3.0, alpha=1.0, points=None)
    # Weight 50 (half speed), holding 1/7 of the replica's weights at TP4: 4/7 of a healthy rank's work at half
    # speed is 8/7 of a healthy rank's time; the others hold 2/7 each: 8/7 too.
    slow, other = power_curve.plan(boost, 1 / 7, 4, weight=50), power_curve.plan(boost, 2 / 7, 4)
    assert slow.load == pytest.approx(8 / 7) == other.load and slow.power == pytest.approx(8 / 7)


def test_a_measured_table_curve_is_interpolated():
    boost = power_curve.boost_model(max_power=1.5, alpha=0.58, points=[[0.5, 0.6], [1.0, 1.0], [1.5, 1.2]])
    chosen = power_curve.plan(boost, share=0.55, tp_base=2)  # load 1.1: halfway between nominal and 1.5
    assert chosen.power == pytest.approx(1.25) and chosen.perf == pytest.approx(1.1)


def test_bad_curve_points_are_a_config_error_naming_the_key():
    with pytest.raises(ValueError, match="ntp.boost_points must give performance 1 at power 1"):
        JobConfig.model_validate({"ntp": {"boost_points": [[1, 1.2], [1.5, 1.3]]}})
    with pytest.raises(ValueError, match="ntp.boost_points must be increasing"):
        JobConfig.model_validate({"ntp": {"boost_points": [[1.5, 1.3], [1, 1]]}})


class FakeNVML:
    """What pynvml offers for power limits, in milliwatts, on one 1,000 W device that allows 200..1,500 W."""

    class NVMLError(Exception):
        pass

    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.limit, self.calls = refuse, 1_000_000, []
        self.refuse_above = None  # milliwatts above which a set is refused (a later raise than the first)

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("handle", uuid)

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle):
        return 1_000_000

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle):
        return 200_000, 1_500_000

    def nvmlDeviceSetPowerManagementLimit(self, handle, milliwatts):
        if self.refuse or (self.refuse_above is not None and milliwatts > self.refuse_above):
            raise self.NVMLError("Insufficient Permissions")
        self.calls.append(("set", handle, milliwatts))
        self.limit = milliwatts


def test_nvml_sets_the_limit_within_the_device_range_and_restores_the_default():
    nvml = FakeNVML()
    limits = power.NvmlLimits(nvml, device_uuid="GPU-3")
    assert limits.set(1.3) == {"applied": True, "watts": 1300.0, "reason": "set through NVML"}
    assert nvml.calls[-1] == ("set", ("handle", "GPU-3"), 1_300_000)  # the device by its UUID, never an index
    assert limits.set(2.0)["watts"] == 1500.0 and nvml.limit == 1_500_000  # clamped to the device's maximum
    assert limits.restore() == {"applied": True, "watts": 1000.0, "reason": "default limit restored"}
    assert nvml.limit == 1_000_000
    limits.restore()  # nothing changed since: no call
    assert sum(1 for c in nvml.calls if c[0] == "set") == 3


def test_a_limit_raised_before_a_refusal_is_still_restored():
    nvml = FakeNVML()
    limits = power.NvmlLimits(nvml, device_uuid="GPU-0")
    assert limits.set(1.2)["applied"] and nvml.limit == 1_200_000
    nvml.refuse_above = 1_250_000
    assert not limits.set(1.4)["applied"]  # refused: a dry run from now on
    assert limits.restore()["applied"] and nvml.limit == 1_000_000


def test_a_refusal_turns_into_a_dry_run_that_says_why():
    nvml = FakeNVML(refuse=True)
    limits = power.NvmlLimits(nvml, device_uuid="GPU-0")
    first = limits.set(1.2)
    assert not first["applied"] and "Insufficient Permissions" in first["reason"] and first["watts"] == 1200.0
    assert not limits.set(1.1)["applied"]
    assert not limits.restore()["applied"]  # nothing was set: nothing to restore, and the record says so
    assert nvml.limit == 1_000_000


def test_open_limits_is_a_dry_run_without_a_gpu_or_pynvml(monkeypatch):
    assert "no GPU" in power.open_limits(None, dry_run=False).set(1.2)["reason"]
    dry = power.open_limits("GPU-0", dry_run=True)
    assert "ntp.boost_dry_run" in dry.set(1.2)["reason"] and not dry.restore()["applied"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert "pynvml is not installed" in power.open_limits("GPU-0", dry_run=False).set(1.2)["reason"]
    broken = types.ModuleType("pynvml")
    broken.nvmlInit = lambda: (_ for _ in ()).throw(RuntimeError("driver not loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert "NVML unavailable (driver not loaded)" in power.open_limits("GPU-0", dry_run=False).set(1.2)["reason"]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML())
    assert isinstance(power.open_limits("GPU-0", dry_run=False), power.NvmlLimits)
