"""The emulated device's share of a replica's TP-split weights (ntp_megatron.speed.device_model.tp_share)."""

from __future__ import annotations

import pytest
import torch

from ntp_megatron.core.layers import HeldUnits
from ntp_megatron.speed.device_model import tp_share


def _param(rows: int, units: tuple[int, ...], num_units: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(rows, 4))
    p.ntp_held_units = HeldUnits("ffn", num_units, units, 1, rows // len(units) * 4)
    return p


def test_held_units_count_their_share_of_the_whole_tensor():
    """3 of 8 units of one tensor and 2 of 4 of another (each whole: 8 and 4 units' worth of elements): 3 + 2
    held units' elements over 8 + 4 units' worth, weighted by element count; a replicated tensor does not count."""
    held = [_param(6, (0, 1, 2), 8), _param(4, (1, 3), 4), torch.nn.Parameter(torch.zeros(5))]
    assert tp_share(held, tp_size=3) == pytest.approx((24 + 16) / (24 * 8 / 3 + 16 * 4 / 2))


def test_without_tags_the_share_is_even():
    assert tp_share([torch.nn.Parameter(torch.zeros(3, 3))], tp_size=4) == 0.25
