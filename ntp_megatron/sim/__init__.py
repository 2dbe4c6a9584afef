"""Cluster-scale goodput simulator for NTP and the recovery strategies it competes with (see docs/simulator.md).

Pure numpy: it never imports torch or Megatron, so it loads and runs on any laptop.
"""
