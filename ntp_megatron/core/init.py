"""Layout-free initial weights: every element is a pure function of (seed, parameter name, global element index).

Why: Megatron's CPU initialisation draws every full-size master weight on every rank and slices it (O(model) time
and host memory per rank), and its GPU initialisation seeds per TP rank, so its values depend on the layout. Here
each rank computes only the elements of its own units, on its own device, in chunks: O(local) time, O(local +
chunk) memory, and the same value for an element whatever layout holds it (any unit list, uneven, non-contiguous).

The global element index of a TP-split tensor is taken over the tensor folded as ``[units, outer, inner]`` (see
:class:`ntp_megatron.core.layers.HeldUnits`), partition dimension outermost, so every unit is one contiguous range of
indices. A replicated tensor is one unit.

The generator is counter-based: SplitMix64's finaliser over ``key + (index + 1) * golden_gamma`` (``key`` hashes
the seed and the name) gives 24 uniform bits, and Wichura's AS241 inverse normal CDF turns them into a standard
normal (7 digits, float32's precision). Everything is written with integer ops and IEEE-exact float32
``+ - * / sqrt`` (the logarithm of the tails too), each a separate torch op (no fused multiply-add), so a value
does not depend on vectorisation, chunking or the device (CPU and CUDA round these ops alike; only CPU is tested).

What each parameter gets follows Megatron-Core's own initialisation: ``init_method`` (N(0, init_method_std)) for
QKV, FC1 and an untied output layer, ``output_layer_init_method`` (the std scaled by 1/sqrt(2 num_layers)) for the
attention projection and FC2, ``embedding_init_method`` for word and position embeddings, zeros for biases, norm
weights left as constructed (ones).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import re
from typing import Callable, Iterator, Optional

import torch

from ntp_megatron.core.layers import HeldUnits

logger = logging.getLogger(__name__)

CHUNK = 1 << 18
"""Elements generated at once on CPU: bounds the temporary memory (a few int64 / float32 buffers of this size)."""
CHUNK_CUDA = 1 << 24
"""On a GPU: about 100 small kernels per chunk, so chunks are large (a few hundred MB of temporaries)."""

INIT_CHOICES = ("megatron", "layout_free")


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def stream_key(seed: int, name: str) -> int:
    """A parameter's 64-bit stream key: a stable hash of (seed, name), the same in every process."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def uniform_bits(key: int, start: int, count: int, device) -> torch.Tensor:
    """24 uniform bits (int64) for global indices ``start .. start + count - 1`` of stream ``key``: the top bits
    of SplitMix64's output. In place: large temporaries cost page faults on every chunk."""
    z = torch.arange(start + 1, start + count + 1, dtype=torch.int64, device=device).mul_(_GAMMA).add_(key)
    t = torch.empty_like(z)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, 1)):
        # z ^= z >>> shift (torch's >> is arithmetic: mask the sign copies), then *= multiplier
        torch.bitwise_right_shift(z, shift, out=t).bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(t)
        if multiplier != 1:
            z.mul_(multiplier)
    return z.bitwise_right_shift_(40).bitwise_and_((1 << 24) - 1)


# Wichura (1988), algorithm AS241 PPND7: rational approximations of the inverse normal CDF to about 1e-7 relative,
# float32's own precision. Coefficients from the constant term up; denominators' constant term is 1. The far-tail
# branch (r > 5, p < 1.4e-11) is never reached: the smallest uniform is 2^-25.
_CENTRAL_NUM = (3.3871327179, 50.434271938, 159.29113202, 59.109374720)
_CENTRAL_DEN = (1.0, 17.895169469, 78.757757664, 67.187563600)
_TAIL_NUM = (1.4234372777, 2.7568153900, 1.3067284816, 0.17023821103)
_TAIL_DEN = (1.0, 0.73700164250, 0.12021132975)
_LN2 = 0.6931471805599453094


def _poly(x: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """Horner's rule, one torch op per step (no fused multiply-add: the same rounding on every device)."""
    out = torch.full_like(x, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        out.mul_(x).add_(c)
    return out


def _log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive float32 from exact ops: x = m 2^e with m in [sqrt(1/2), sqrt(2)), then
    log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172, as a series (6 terms: below 1e-9)."""
    mantissa, exponent = torch.frexp(x)  # mantissa in [0.5, 1)
    low = (mantissa < math.sqrt(0.5)).to(x.dtype)
    mantissa.mul_(low + 1.0)  # exact: times 1 or 2
    exponent = exponent.to(x.dtype).sub_(low)
    s = (mantissa - 1.0).div_(mantissa.add_(1.0))
    series = _poly(s * s, tuple(1.0 / (2 * k + 1) for k in range(6)))
    return series.mul_(s).mul_(2.0).add_(exponent.mul_(_LN2))


def standard_normal(bits: torch.Tensor, gather_tail: Optional[bool] = None) -> torch.Tensor:
    """float32 standard normals from 24 uniform bits each: the lowest bit is the sign, the other 23 give the
    probability of the smaller tail, p = (k + 1/2) / 2^24 (exact in float32, so |z| <= 5.4), and AS241 PPND7
    its quantile. ``gather_tail`` (default: on CPU) computes the tail branch only for the elements that take it;
    otherwise (GPU) for every element, then picks, with no host sync: the same values either way."""
    if gather_tail is None:
        gather_tail = bits.device.type == "cpu"
    sign = (bits & 1).to(torch.float32).mul_(-2.0).add_(1.0)
    p = bits.bitwise_right_shift_(1).to(torch.float32).add_(0.5).mul_(2.0 ** -24)
    q = 0.5 - p  # exact
    r = (q * q).neg_().add_(0.180625)
    central = q.mul_(_poly(r, _CENTRAL_NUM)).div_(_poly(r, _CENTRAL_DEN))
    in_tail = p < 0.075  # about 15 %
    if gather_tail:  # only these pay for the logarithm
        tail = in_tail.nonzero().squeeze_(1)
        r = _log(p.index_select(0, tail)).neg_().sqrt_().sub_(1.6)
        central.index_copy_(0, tail, _poly(r, _TAIL_NUM).div_(_poly(r, _TAIL_DEN)))
    else:  # the tail formula is defined for every p in (0, 1/2]: its denominator has no root there
        r = _log(p).neg_().sqrt_().sub_(1.6)
        central = torch.where(in_tail, _poly(r, _TAIL_NUM).div_(_poly(r, _TAIL_DEN)), central)
    return central.mul_(sign)


def normal(key: int, start: int, count: int, std: float, device) -> torch.Tensor:
    """float32 N(0, std) for global indices ``start .. start + count - 1`` of stream ``key``."""
    return standard_normal(uniform_bits(key, start, count, device)).mul_(std)


def _runs(units: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """(first global unit, first local position, length) of each run of consecutive units."""
    start = 0
    for i in range(1, len(units) + 1):
        if i == len(units) or units[i] != units[i - 1] + 1:
            yield units[start], start, i - start
            start = i


@torch.no_grad()
def fill_normal_(param: torch.Tensor, key: int, std: float, held: Optional[HeldUnits],
                 chunk: Optional[int] = None) -> None:
    """Write N(0, std) into ``param`` (this rank's units of ``held``, or the whole tensor if replicated), at most
    ``chunk`` (default :data:`CHUNK`, :data:`CHUNK_CUDA` on a GPU) elements at a time, on the parameter's
    device."""
    chunk = chunk or (CHUNK if param.device.type == "cpu" else CHUNK_CUDA)
    if held is None:
        held = HeldUnits("replicated", 1, (0,), 1, param.numel())
    outer, inner = held.outer, held.inner
    unit_numel = outer * inner
    local = param.view(outer, len(held.units), inner)
    device = param.device
    for first_unit, first_local, count in _runs(held.units):
        base = first_unit * unit_numel
        if outer == 1:  # the run is contiguous in memory and in index order
            flat = local[0, first_local:first_local + count].view(-1)
            for a in range(0, flat.numel(), chunk):
                n = min(chunk, flat.numel() - a)
                flat[a:a + n].copy_(normal(key, base + a, n, std, device))
        elif unit_numel <= chunk:  # whole units at a time: values in [unit, outer, inner] order
            per = chunk // unit_numel
            for j in range(0, count, per):
                n = min(per, count - j)
                values = normal(key, base + j * unit_numel, n * unit_numel, std, device).view(n, outer, inner)
                local[:, first_local + j:first_local + j + n].copy_(values.transpose(0, 1))
        else:  # a unit larger than a chunk: rows of it
            rows = max(1, chunk // inner)
            for j in range(count):
                for o in range(0, outer, rows):
                    m = min(rows, outer - o)
                    values = normal(key, base + j * unit_numel + o * inner, m * inner, std, device)
                    local[o:o + m, first_local + j].copy_(values.view(m, inner))


def normal_std(init_method: Callable) -> float:
    """The std of one of Megatron's normal init methods (``init_method_normal`` / ``scaled_init_method_normal``)."""
    if (isinstance(init_method, functools.partial) and init_method.func is torch.nn.init.normal_
            and init_method.keywords.get("mean", 0.0) == 0.0 and not init_method.args):
        return float(init_method.keywords.get("std", 1.0))
    raise ValueError(f"model.init: layout_free reproduces Megatron's normal init methods only, not {init_method!r}")


_NORMAL_KINDS = (  # parameter name suffix -> which of Megatron's init methods draws it
    ("embedding.word_embeddings.weight", "embedding_init_method"),
    ("embedding.position_embeddings.weight", "embedding_init_method"),
    ("self_attention.linear_qkv.weight", "init_method"),
    ("mlp.linear_fc1.weight", "init_method"),
    ("output_layer.weight", "init_method"),
    ("self_attention.linear_proj.weight", "output_layer_init_method"),
    ("mlp.linear_fc2.weight", "output_layer_init_method"),
)


def megatron_init_of(name: str, tf_config) -> Optional[Callable]:
    """Megatron's init method for parameter ``name`` of a GPTModel; None for one Megatron zeroes (biases) or
    leaves as constructed (norms)."""
    for suffix, attribute in _NORMAL_KINDS:
        if name.endswith(suffix):
            return getattr(tf_config, attribute)
    if name.endswith(".bias") or "norm" in name.rsplit(".", 2)[-2]:
        return None
    raise ValueError(f"model.init: layout_free does not know how Megatron initialises parameter {name!r}")


_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
TIED_OUTPUT = "output_layer.weight"
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


def global_name(name: str, layer_offset: int, tied_copy: bool = False) -> str:
    """The name a parameter of one pipeline stage has in the whole model: its transformer layer numbered globally
    (a stage numbers its layers from 0; ``layer_offset`` is Megatron's ``get_transformer_layer_offset``), and the
    last stage's copy of tied word embeddings (``tied_copy``) named as the first stage's original (also in the
    name of its state: ``output_layer.weight.exp_avg``)."""
    if tied_copy and TIED_OUTPUT in name:
        return name.replace(TIED_OUTPUT, WORD_EMBEDDINGS, 1)
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", name, count=1)


@torch.no_grad()
def initialize_layout_free(model: torch.nn.Module, tf_config, seed: int,
                           held_units_of: Callable[[str, torch.nn.Parameter], Optional[HeldUnits]],
                           layer_offset: int = 0) -> None:
    """Initialise every parameter of ``model`` (an unwrapped GPTModel, NTP or plain, or one pipeline stage of it,
    its first layer being global layer ``layer_offset``) from (seed, global name, index).

    ``held_units_of(name, param)`` says which units of a TP-split parameter this rank holds (None: replicated).
    """
    for name, param in model.named_parameters():
        name_in_model = global_name(name, layer_offset, tied_copy=getattr(param, "shared_embedding", False))
        init_method = megatron_init_of(name_in_model, tf_config)
        if init_method is not None:
            fill_normal_(param, stream_key(seed, name_in_model), normal_std(init_method), held_units_of(name, param))
        elif name.endswith(".bias"):
            param.zero_()  # Megatron zeroes linear biases; norm biases are constructed as zeros
    logger.debug("layout-free initialisation: %d elements on this rank", sum(p.numel() for p in model.parameters()))
