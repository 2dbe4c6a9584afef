"""configs/tiny_cpu.yaml against the schema: it lists every key, and each value is the schema's default unless its
comment says ``(schema default: X)`` — and then X is the schema's default and the value is not.

So the file can be read as documentation of the defaults: changing a default in ntp_megatron/config/schema.py without
the file (or the file without a marker) fails here.
"""

from __future__ import annotations

import re

from ntp_megatron.config.schema import DEFAULT_CONFIG, JobConfig
from ntp_megatron.config.files import parse_yaml, read_yaml_file

MARKER = re.compile(r"\(schema default: ([^)]*)\)")
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>\w+):(?P<rest>.*)$")


def schema_defaults() -> dict[str, object]:
    return {f"{section}.{name}": field.get_default(call_default_factory=True)
            for section, info in JobConfig.model_fields.items()
            for name, field in info.annotation.model_fields.items()}


def yaml_entries(text: str) -> dict[str, tuple[object, str]]:
    """``section.key`` → (its value, the comment on its line) for every key line of a two-level config file."""
    values = parse_yaml(text)
    entries: dict[str, tuple[object, str]] = {}
    section = None
    for line in text.splitlines():
        match = KEY_LINE.match(line)
        if not match:
            continue
        comment = match["rest"].partition("#")[2]
        if not match["indent"]:
            section = match["key"]
        else:
            entries[f"{section}.{match['key']}"] = (values[section][match["key"]], comment)
    return entries


def check_against_schema(text: str, defaults: dict[str, object]) -> list[str]:
    """Every disagreement between a config file written to this convention and the schema, one line each."""
    entries = yaml_entries(text)
    problems = [f"{key}: missing from the file" for key in defaults if key not in entries]
    problems += [f"{key}: not a schema key" for key in entries if key not in defaults]
    for key, (value, comment) in entries.items():
        if key not in defaults:
            continue
        marker = MARKER.search(comment)
        if marker is None:
            if value != defaults[key]:
                problems.append(f"{key}: {value!r} is not the schema default {defaults[key]!r} and its comment "
                                "does not say '(schema default: ...)'")
            continue
        claimed = parse_yaml(marker[1])
        if claimed != defaults[key]:
            problems.append(f"{key}: the comment claims schema default {claimed!r}, the schema says "
                            f"{defaults[key]!r}")
        if value == defaults[key]:
            problems.append(f"{key}: marked as differing from the schema default, but it is the default")
    return problems


def test_tiny_cpu_yaml_lists_every_key_at_the_schema_default_unless_marked():
    problems = check_against_schema(DEFAULT_CONFIG.read_text(), schema_defaults())
    assert not problems, "\n".join(problems)


def test_ntp_is_on_by_default_in_schema_and_default_config():
    assert JobConfig().ntp.enabled is True
    assert read_yaml_file(DEFAULT_CONFIG)["ntp"]["enabled"] is True


def test_the_check_catches_each_kind_of_disagreement():
    defaults = {"a.x": 1, "a.y": None, "a.z": 0.1}
    good = "a:\n  x: 1\n  y: null      # null: off\n  z: 0.0   # (schema default: 0.1)\n"
    assert check_against_schema(good, defaults) == []
    cases = {
        "a:\n  x: 1\n  y: null\n": "a.z: missing",
        "a:\n  x: 2\n  y: null\n  z: 0.0   # (schema default: 0.1)\n": "a.x: 2 is not the schema default",
        "a:\n  x: 1\n  y: null\n  z: 0.0   # (schema default: 0.2)\n": "claims schema default 0.2",
        "a:\n  x: 1   # (schema default: 1)\n  y: null\n  z: 0.0   # (schema default: 0.1)\n": "but it is the default",
        "a:\n  x: 1\n  y: null\n  z: 0.0   # (schema default: 0.1)\n  w: 3\n": "a.w: not a schema key",
    }
    for text, expected in cases.items():
        problems = check_against_schema(text, defaults)
        assert any(expected in p for p in problems), (text, problems)
