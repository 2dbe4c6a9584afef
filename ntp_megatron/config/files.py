"""YAML files + dotted ``--set`` overrides + pydantic validation, with one-line errors for CLIs.

Every CLI of the project (training, simulator) loads its config through :func:`load_config`, so a bad key
or value reads the same everywhere: one line naming the key and what is allowed, exit code 2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

EXIT_CONFIG_ERROR = 2


class ConfigError(ValueError):
    """A config problem stated in one line."""


class _Loader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1 base-60 numbers, so ``1:3`` stays the string "1:3" (not 63)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
        r"|\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    """Parse YAML the way every config of ours is parsed (no base-60 surprises)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = parse_yaml(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML (``[1:3]`` is a list)."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {assignment!r}: expected section.key=value, e.g. training.train_iters=20")
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _section_fields(model_cls: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) section that ``loc`` points into, for 'allowed keys' hints."""
    cls: Any = model_cls
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return []
        cls = field.annotation
    return list(cls.model_fields) if isinstance(cls, type) and issubclass(cls, BaseModel) else []


def format_validation_error(exc: ValidationError, model_cls: type[BaseModel] | None = None) -> str:
    """The first problem of a pydantic error as one line: the dotted key, what is wrong, what was given."""
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "<top level>"
    if err["type"] == "extra_forbidden":
        allowed = _section_fields(model_cls, tuple(err["loc"][:-1])) if model_cls else []
        hint = f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
        return f"unknown config key '{key}'{hint}"
    msg = err["msg"]
    if err["type"] == "value_error":  # our own validators name their keys already
        return msg.removeprefix("Value error, ")
    if "input" in err and err["type"] != "missing":
        return f"bad value for '{key}': {msg} (got {err['input']!r})"
    return f"'{key}': {msg}"


def validate(model_cls: type[M], data: dict[str, Any]) -> M:
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model_cls)) from None


def load_config(
    model_cls: type[M], path: str | Path | None = None, overrides: Iterable[str] = (), base: dict | None = None
) -> M:
    """Read ``path`` (or start from ``base``), apply ``--set`` overrides in order, validate with ``model_cls``."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = read_yaml_file(path)
    for assignment in overrides:
        apply_override(data, assignment)
    return validate(model_cls, data)
