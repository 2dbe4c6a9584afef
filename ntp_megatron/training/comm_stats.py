"""Per-rank counts of torch.distributed calls and their payload bytes (``logging.comm_stats``).

A measurement aid for ``scripts/bench.sh``: it shows what a rank's step costs in communication, so that a
healthy rank of a job with a degraded replica can be compared with the same rank of a job without one. The
functions of ``torch.distributed`` are wrapped at module level, which is where Megatron-Core and this package
look them up at call time. Payload bytes are the bytes of the tensors handed to each call (for an all-reduce,
the buffer reduced; for a send, the buffer sent), not what the backend puts on the wire.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist

_WRAPPED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
            "reduce_scatter", "reduce", "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv",
            "barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter")


def _payload(args: tuple, kwargs: dict) -> int:
    """Bytes of the first tensor argument (the buffer reduced, broadcast or sent); 0 for object collectives."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor):
            return arg.numel() * arg.element_size()
    return 0


class CommStats:
    """Counts calls and payload bytes per function name until :meth:`take` resets them."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self._originals: dict[str, Callable[..., Any]] = {}

    def install(self) -> "CommStats":
        for name in _WRAPPED:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.calls[name] += 1
            self.bytes[name] += _payload(args, kwargs)
            return original(*args, **kwargs)

        return counted

    def take(self) -> dict[str, dict[str, int]]:
        """What was counted since the last call, then start again from zero."""
        out = {"calls": dict(sorted(self.calls.items())), "bytes": dict(sorted(self.bytes.items()))}
        self.calls.clear()
        self.bytes.clear()
        return out
