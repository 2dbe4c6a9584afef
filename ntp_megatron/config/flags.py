"""Megatron-LM's command-line flags, as ``ntp-launch`` understands them: each becomes ``--set`` overrides.

A flag named after a config key (``--train-iters 20``) sets that key. Megatron's own spellings of what the
project supports under another name (``--bf16``, ``--swiglu``, ``--distributed-timeout-minutes``) are translated
here; what Megatron offers and the project does not support yet (virtual or uneven pipeline stages, other
tokenizers, ...) is refused by name, so a Megatron user learns why at once instead of reading "unknown argument".
"""

from __future__ import annotations

import json
import textwrap
from typing import Callable, Optional, Sequence

from ntp_megatron.config.schema import JobConfig
from ntp_megatron.config.files import ConfigError

BYTE_LEVEL_NAMES = ("byte-level", "ByteLevel", "ByteLevelTokenizer")


def field_index() -> dict[str, str]:
    """``flag_name`` → ``section.flag_name`` for every config field whose name is unique to one section."""
    owners: dict[str, list[str]] = {}
    for section, info in JobConfig.model_fields.items():
        for name in info.annotation.model_fields:
            owners.setdefault(name, []).append(section)
    return {name: f"{secs[0]}.{name}" for name, secs in owners.items() if len(secs) == 1}


def _switch(*overrides: str) -> Callable[[Optional[str]], list[str]]:
    def apply(value: Optional[str]) -> list[str]:
        if value is not None:
            raise ConfigError("takes no value")
        return list(overrides)
    return apply


def _renamed(key: str, convert: Callable[[str], str] = str) -> Callable[[Optional[str]], list[str]]:
    def apply(value: Optional[str]) -> list[str]:
        if value is None:
            raise ConfigError("needs a value")
        return [f"{key}={convert(value)}"]
    return apply


def _at_most_one(what: str) -> Callable[[Optional[str]], list[str]]:
    """A parallel size Megatron has and the project supports only at 1."""
    def apply(value: Optional[str]) -> list[str]:
        if value is None or value.strip() != "1":
            raise ConfigError(f"{what} is not supported yet (only size 1)")
        return []
    return apply


def _tokenizer(value: Optional[str]) -> list[str]:
    if value in BYTE_LEVEL_NAMES:
        return ["data.tokenizer=byte-level"]
    raise ConfigError(f"tokenizer {value!r} is not supported: only the byte-level tokenizer, which needs no "
                      f"vocabulary file (nothing is downloaded at run time); use --tokenizer-type byte-level and "
                      "build data with ntp-preprocess")


def _minutes(value: str) -> str:
    try:
        return str(float(value) * 60)
    except ValueError:
        raise ConfigError(f"expects minutes, got {value!r}") from None


ALIASES: dict[str, tuple[Callable[[Optional[str]], list[str]], str]] = {
    "bf16": (_switch("training.precision=bf16"), "training.precision=bf16"),
    "fp16": (_switch("training.precision=fp16"), "training.precision=fp16"),
    "swiglu": (_switch("model.gated_linear_unit=true", "model.activation=swiglu"),
               "model.gated_linear_unit=true, model.activation=swiglu"),
    "squared-relu": (_switch("model.activation=squared_relu"), "model.activation=squared_relu"),
    "group-query-attention": (_switch(), "GQA is on when --num-query-groups is set"),
    "use-mcore-models": (_switch(), "always Megatron-Core models"),
    "mock-data": (_switch("data.mock=true"), "data.mock=true"),
    "norm-epsilon": (_renamed("model.layernorm_epsilon"), "model.layernorm_epsilon"),
    "distributed-backend": (_renamed("parallel.backend"), "parallel.backend"),
    "distributed-timeout-minutes": (_renamed("parallel.timeout_s", _minutes), "parallel.timeout_s (× 60)"),
    "data-cache-path": (_renamed("data.cache_dir"), "data.cache_dir"),
    "tokenizer-type": (_tokenizer, "byte-level only"),
    "context-parallel-size": (_at_most_one("context parallelism"), "1 only"),
    "expert-model-parallel-size": (_at_most_one("expert parallelism (mixture of experts)"), "1 only"),
}
"""Megatron flag → (its translation, what it sets: for ``--help``)."""

UNSUPPORTED: dict[str, str] = {
    "virtual-pipeline-model-parallel-size": "virtual pipeline stages (the interleaved schedule) are not supported "
                                            "yet: only Megatron's 1F1B schedule",
    "num-layers-per-virtual-pipeline-stage": "virtual pipeline stages (the interleaved schedule) are not supported "
                                             "yet: only Megatron's 1F1B schedule",
    "decoder-first-pipeline-num-layers": "uneven pipeline stages are not supported yet: every stage has "
                                         "num-layers / pipeline-model-parallel-size layers",
    "decoder-last-pipeline-num-layers": "uneven pipeline stages are not supported yet: every stage has "
                                        "num-layers / pipeline-model-parallel-size layers",
    "pipeline-model-parallel-layout": "uneven pipeline stages are not supported yet: every stage has "
                                      "num-layers / pipeline-model-parallel-size layers",
    "account-for-embedding-in-pipeline-split": "uneven pipeline stages are not supported yet: every stage has "
                                               "num-layers / pipeline-model-parallel-size layers",
    "account-for-loss-in-pipeline-split": "uneven pipeline stages are not supported yet: every stage has "
                                          "num-layers / pipeline-model-parallel-size layers",
    "num-experts": "mixture of experts is not supported yet",
    "fp8-format": "FP8 training is not supported yet",
    "train-samples": "sample-based training is not supported yet: use --train-iters",
    "lr-warmup-fraction": "a warmup fraction is not supported: use --lr-warmup-iters",
    "lr-warmup-samples": "sample-based schedules are not supported: use --lr-warmup-iters",
    "lr-decay-samples": "sample-based schedules are not supported: use --lr-decay-iters",
    "vocab-file": "vocabulary files are not supported: only the byte-level tokenizer (no downloads at run time)",
    "merge-file": "merge files are not supported: only the byte-level tokenizer (no downloads at run time)",
    "tokenizer-model": "tokenizer models are not supported: only the byte-level tokenizer (no downloads at run time)",
    "recompute-granularity": "activation recomputation is not supported yet",
    "recompute-activations": "activation recomputation is not supported yet",
    "fp32-residual-connection": "an fp32 residual stream is not supported yet",
    "disable-bias-linear": "linear layers without biases are not supported yet",
}
"""Megatron flags the project knows it does not support, with the reason given to the user."""


def translate(extra: Sequence[str]) -> list[str]:
    """Megatron-style flags (``--train-iters 20``, ``--bf16``, ``--data-path A B``) → ``--set`` overrides, in
    order; ConfigError with one line for anything refused."""
    index = field_index()
    overrides: list[str] = []
    i = 0
    while i < len(extra):
        flag = extra[i]
        if not flag.startswith("--"):
            raise ConfigError(f"unexpected argument {flag!r}; flags look like --train-iters 20")
        name, eq, inline = flag[2:].partition("=")
        values = [inline] if eq else []
        i += 1
        while not eq and i < len(extra) and not extra[i].startswith("--"):
            values.append(extra[i])
            i += 1
        key = name.replace("-", "_")
        if key == "data_path":
            if not values:
                raise ConfigError("--data-path needs at least one preprocessed prefix")
            overrides += ["data.mock=false", "data.data_path=" + json.dumps(values)]
            continue
        if name in UNSUPPORTED:
            raise ConfigError(f"--{name}: {UNSUPPORTED[name]}")
        if len(values) > 1:
            raise ConfigError(f"--{name} takes one value, got {len(values)}")
        value = values[0] if values else None
        if name in ALIASES:
            try:
                overrides += ALIASES[name][0](value)
            except ConfigError as exc:
                raise ConfigError(f"--{name}: {exc}") from None
        elif key in index:
            overrides.append(f"{index[key]}={value if value is not None else 'true'}")
        else:
            raise ConfigError(f"unknown argument --{name}: neither a config key nor a Megatron flag ntp-launch "
                              "supports (ntp-launch --help lists them; --set section.key=value sets any key)")
    if "--bf16" in extra and "--fp16" in extra:
        raise ConfigError("--bf16 and --fp16 exclude each other: pick one")
    return overrides


def help_text() -> str:
    """The accepted Megatron flags, for ``ntp-launch --help``."""
    flags = ", ".join(f"--{name.replace('_', '-')}" for name in sorted(field_index()) if name != "data_path")
    lines = ["Megatron-style flags (each sets the config key named after it; a flag without a value means true):",
             textwrap.fill(flags, width=100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False),
             "  --data-path PREFIX [PREFIX | W1 P1 W2 P2 ...]  (also sets data.mock=false)",
             "Megatron spellings translated:"]
    lines += [f"  --{name:<32} {what}" for name, (_, what) in sorted(ALIASES.items())]
    lines.append("Refused by name: " + ", ".join(f"--{name}" for name in sorted(UNSUPPORTED)))
    return "\n".join(lines)
