"""Cluster-scale goodput simulator for NTP and the recovery strategies it competes with (see docs/simulator.md).

Pure numpy: it never imports torch or Megatron, so it loads and runs on any laptop.

May import: :mod:`ntp_megatron.plan`, :mod:`ntp_megatron.config.files` (YAML and the one-line error) and
:mod:`ntp_megatron.config` (the job config's model and power-boost sections, which :mod:`.rebalance` models;
neither imports torch), nothing else of the package.
"""
