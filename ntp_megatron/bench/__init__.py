"""Benchmarks (``scripts/bench.sh``): ratios measured side by side in one run, a table and a JSON; never tests.

:mod:`.cli` (the command line: the parts in turn), :mod:`.sizes` (how long each part runs: the default, ``--full``,
``--smoke``), :mod:`.step_time` (step time of NTP against plain Megatron-Core, failures, recovery, checkpoint
stalls), :mod:`.init_weights` (one rank's model initialisation), :mod:`.memory` (training state and re-formation
peaks), :mod:`.control_plane` (the control plane's load test), :mod:`.slow_rank` (a slow rank and power boost),
:mod:`.report` (the table), :mod:`.common` (what the parts share). The soak (``scripts/soak.sh``, a tool of its own
beside the benchmark): :mod:`.soak` (the command line, the jobs, /proc), :mod:`.soak_report` (its report, pure).

May import anything in the package; nothing imports it.
"""
