"""Benchmarks (``scripts/bench.sh``): ratios measured side by side in one run, a table and a JSON; never tests.

:mod:`.step_time` (step time of NTP against plain Megatron-Core, failures, recovery, memory, checkpoint stalls, and
the command line), :mod:`.control_plane` (the control plane's load test), :mod:`.slow_rank` (a slow rank and power
boost).

May import anything in the package; nothing imports it.
"""
