"""Every change ntp-megatron makes to Megatron-Core's own behaviour, applied by one explicit call.

Installed as ``ntp_megatron.patches``. Each module patches one upstream concern and names the upstream
module(s) it touches; :func:`apply_patches` checks the megatron-core version first, because every patch
here was written against the source of one release and may be wrong for another.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

TESTED_MEGATRON_CORE = ("0.16.",)
"""Release prefixes these patches were written and tested against."""

SKIP_VERSION_CHECK_ENV = "NTP_MEGATRON_SKIP_VERSION_CHECK"

_applied: list[str] = []


class UnsupportedMegatronVersion(RuntimeError):
    pass


def check_megatron_version() -> str:
    """The installed megatron-core version; raises if the patches were not written for it."""
    # Megatron-Core loads when the patches are applied, never when this package is imported (the launcher, the
    # simulator and the config import it at no cost)
    from megatron.core.package_info import __version__ as version

    if not version.startswith(TESTED_MEGATRON_CORE) and os.environ.get(SKIP_VERSION_CHECK_ENV) != "1":
        raise UnsupportedMegatronVersion(
            f"ntp-megatron's patches were written for megatron-core {', '.join(v + 'x' for v in TESTED_MEGATRON_CORE)}"
            f" but {version} is installed; install megatron-core==0.16.1 "
            f"(or set {SKIP_VERSION_CHECK_ENV}=1 to try at your own risk)"
        )
    return version


def apply_patches(cpu: bool | None = None) -> list[str]:
    """Apply the patches this process needs, once. ``cpu=None``: the CPU shim iff CUDA is absent.

    Returns the names of the patches in force.
    """
    if _applied:
        return list(_applied)
    import torch  # see check_megatron_version: nothing heavy at import time

    version = check_megatron_version()
    if cpu is None:
        cpu = not torch.cuda.is_available()
    # each patch module imports the Megatron-Core module it patches: loaded only here
    from ntp_megatron.patches import (
        datasets_gpt_dataset,
        dist_checkpointing_checkpointable,
        dist_checkpointing_filesystem_async,
        dist_checkpointing_validation,
        distributed_data_parallel,
        distributed_param_and_grad_buffer,
        optimizer_distrib_optimizer,
        optimizer_grad_norm,
        torch_distributed_c10d,
        torch_distributed_work,
        torch_optim_adam,
    )

    # Bucket groups dispatch in creation order (a rule every member of a sync group can follow); the grad
    # norm runs upstream's code unless NTP registers its layout-independent norm.
    distributed_param_and_grad_buffer.apply()
    distributed_data_parallel.apply()
    optimizer_grad_norm.apply()
    # The distributed optimizer's parameter all-gather can be left to the caller (NTP: after the commit point the
    # step must be local); upstream's step for every optimizer that does not ask.
    optimizer_distrib_optimizer.apply()
    # An upstream bug fix: loss masks must not depend on which sample a process read first.
    datasets_gpt_dataset.apply()
    # Checkpoints of uneven (NTP) shardings: chunks with a layer axis that DCP can store, and the exactly-once
    # coverage check upstream skips for them. Identity for regular grids.
    dist_checkpointing_checkpointable.apply()
    dist_checkpointing_validation.apply()
    # Waits an ended elastic generation can cut short (gloo); upstream's wait until an escape is installed.
    torch_distributed_work.apply()
    # ... and so can the full-mesh connect of a gloo group it forms (a member that died after publishing its address).
    torch_distributed_c10d.apply_connect_escape()
    # A progress mark per parameter in Adam's CPU step (the hang detection's; bit for bit upstream's update).
    torch_optim_adam.apply()
    # Where a rank collects its checkpoint writes: the phase checkpoint_write of --inject-failure.
    dist_checkpointing_filesystem_async.apply_write_point()
    _applied.extend(["distributed_param_and_grad_buffer", "distributed_data_parallel", "optimizer_grad_norm",
                     "optimizer_distrib_optimizer (deferrable param gather)", "datasets_gpt_dataset",
                     "dist_checkpointing_checkpointable", "dist_checkpointing_validation", "torch_distributed_work",
                     "torch_distributed_c10d (connect escape)", "torch_optim_adam",
                     "dist_checkpointing_filesystem_async (write point)"])
    if cpu:
        # the CPU-only patches, loaded on a CPU run only
        from ntp_megatron.patches import (
            cpu_shim,
            optimizer_clip_grads,
            optimizer_grad_scaler,
            optimizer_optimizer,
            tensor_parallel_random,
        )

        cpu_shim.apply()
        tensor_parallel_random.apply()
        optimizer_clip_grads.apply()
        optimizer_optimizer.apply()  # bf16 / fp16: upstream accepts CUDA tensor types only
        optimizer_distrib_optimizer.apply_cpu()
        optimizer_grad_scaler.apply()  # fp16 checkpoints: the loss scale restored without .cuda()
        dist_checkpointing_filesystem_async.apply()  # a forked, not spawned, results queue for checkpoint writes
        _applied.extend(["cpu_shim", "tensor_parallel_random", "optimizer_clip_grads", "optimizer_optimizer",
                         "optimizer_distrib_optimizer (CPU types)", "optimizer_grad_scaler",
                         "dist_checkpointing_filesystem_async"])
    from ntp_megatron.patches import optimizer_param_groups  # after the CPU shim (below)

    # After the CPU shim, whose view of torch it wraps. Inactive until NTP switches it on.
    optimizer_param_groups.apply()
    _applied.append("optimizer_param_groups")
    logger.info("megatron-core %s; patches applied: %s", version, ", ".join(_applied) or "none")
    return list(_applied)
