"""ntp-megatron: Nonuniform Tensor Parallelism for Megatron-Core, with live re-formation on failure.

Importing the package is cheap on purpose: torch and Megatron-Core are imported only by the modules that
need them, so pure modules (layout math, config, the goodput simulator) load in milliseconds.
"""

__version__ = "0.1.0"
