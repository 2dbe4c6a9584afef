"""A rank's pace: measuring it, emulating a device on CPU, and drawing more power where a rank must keep up.

:mod:`.compute_time` (a rank's compute time per iteration, waits on peers excluded: the host clock or CUDA
events), :mod:`.device_model` (the emulated device for CPU tests and benchmarks), :mod:`.power` (power boost
through NVML, or a dry run that records what it would set). The decisions themselves are pure and live in
:mod:`ntp_megatron.plan.rebalance` and :mod:`ntp_megatron.plan.power_curve`.

May import: :mod:`ntp_megatron.plan` and :mod:`ntp_megatron.phases`, nothing else of the package.
"""
