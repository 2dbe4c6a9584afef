"""Building an optimizer without talking to other ranks (upstream: ``megatron.core.optimizer.__init__``,
``_get_param_groups``).

``get_megatron_optimizer`` all-gathers every rank's parameter-group keys over the whole world, so that ranks
whose models differ still agree on the groups. Under NTP every rank has the same parameters by name (layouts
change shapes, never names), so the gather can only return this rank's own keys — and it would deadlock a
re-formation, where only the ranks of the replica that lost a rank build a new optimizer. With
:func:`set_identical_param_groups` on, that gather is answered locally; otherwise upstream's runs.
"""

from __future__ import annotations

import types
from typing import Any

from megatron.core import optimizer as upstream

_identical = False


def set_identical_param_groups(on: bool) -> None:
    """Every rank of the job has the same parameter names (true under NTP): skip the key gather."""
    global _identical
    _identical = on


class _Distributed(types.ModuleType):
    def __init__(self, real) -> None:
        super().__init__("ntp_megatron.patches.optimizer_param_groups.distributed")
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def all_gather_object(self, object_list: list, obj: Any, group=None) -> None:
        if not _identical:
            return self._real.all_gather_object(object_list, obj, group=group)
        object_list[:] = [obj] * len(object_list)


class _Torch(types.ModuleType):
    def __init__(self, real) -> None:
        super().__init__("ntp_megatron.patches.optimizer_param_groups.torch")
        self._real = real
        self.distributed = _Distributed(real.distributed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def apply() -> None:
    """Wraps whatever ``torch`` the module sees (the real one, or the CPU shim's view: apply after it)."""
    upstream.torch = _Torch(upstream.torch)
