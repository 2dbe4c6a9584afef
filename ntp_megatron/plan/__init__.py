"""Pure planning: what NTP decides, with no torch.distributed, no store and no Megatron-Core.

:mod:`.layout` (one stage's layout: units, canonical blocks, layouts, proxies, sync groups, move plans), :mod:`.stages`
(a job's topology, one layout per pipeline stage: the one topology type the rest of the package uses), :mod:`.grid`
(Megatron's rank grid), :mod:`.placement` (which node and device a slot runs on), :mod:`.group_plan` (which process
groups a rank is in), :mod:`.memory_plan` (a rank's planned state bytes per TP degree), :mod:`.optimizer_shards` (the
distributed optimizer's buffer geometry: which rank holds which shard, twins), :mod:`.rebalance` (the decision to give a
slow rank a smaller share), :mod:`.power_curve` (the power-performance curve the runtime and the simulator share).

May import: :mod:`ntp_megatron.config.files` (its error type) and nothing else of the package. Every module here
loads in milliseconds and is unit-tested without processes.
"""
