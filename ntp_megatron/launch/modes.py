"""The run modes, and the death policy of each, chosen once when the launcher starts.

- NTP, node 0 (:class:`~ntp_megatron.launch.ntp.ControllerPolicy`): the controller absorbs a death into a new
  generation; what it cannot absorb is dropped or stops the job (``ntp.on_unrecoverable: drop_replica`` or
  ``stop``, decided in the controller), or restarts the job on the surviving slots (``restart``:
  :class:`~ntp_megatron.launch.ntp.RestartSurvivorsPolicy`).
- NTP, another node (:class:`~ntp_megatron.launch.ntp.WorkerNodePolicy`): deaths go to node 0's controller through
  the store.
- NTP off with ``checkpoint.save``, one node: the job restarts from the last checkpoint
  (:class:`~ntp_megatron.launch.policy.RestartFromCheckpoint`).
- NTP off otherwise: the job stops (:class:`~ntp_megatron.launch.policy.StopOnFailure`).
"""

from __future__ import annotations

from ntp_megatron.launch import ntp
from ntp_megatron.launch.policy import DeathPolicy, LauncherView, RestartFromCheckpoint, StopOnFailure


def choose(launcher: LauncherView) -> DeathPolicy:
    """The policy of this run: by whether NTP is on, which node this is, and what the config says."""
    cfg = launcher.cfg
    if cfg.ntp.enabled:
        if launcher.args.node_rank != 0:
            return ntp.WorkerNodePolicy(launcher)
        if cfg.ntp.on_unrecoverable == "restart":
            return ntp.RestartSurvivorsPolicy(launcher)
        return ntp.ControllerPolicy(launcher)
    if cfg.checkpoint.save is not None and not launcher.nodes.multi:
        return RestartFromCheckpoint(launcher)
    return StopOnFailure(launcher)
