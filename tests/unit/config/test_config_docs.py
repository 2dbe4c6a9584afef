"""docs/configuration.md is what ``python -m ntp_megatron.config.docs`` writes from the schema, so the reference
cannot drift from the code; and the generator covers every key with a description."""

from __future__ import annotations

import difflib

from ntp_megatron.config import docs
from ntp_megatron.config.schema import JobConfig


def test_committed_configuration_md_is_current():
    expected = docs.render()
    committed = docs.DOCS_FILE.read_text() if docs.DOCS_FILE.is_file() else ""
    diff = "".join(difflib.unified_diff(committed.splitlines(True), expected.splitlines(True),
                                        "docs/configuration.md (committed)", "generated", n=1))
    assert committed == expected, f"docs/configuration.md is out of date: run {docs.COMMAND}\n{diff[:4000]}"


def test_every_key_has_a_docstring_and_a_row():
    text = docs.render()
    for section, info in JobConfig.model_fields.items():
        assert info.annotation.__doc__, f"section {section} has no docstring"
        assert f"## `{section}`" in text
        for name, field in info.annotation.model_fields.items():
            assert field.description, f"{section}.{name} has no docstring"
            rows = [line for line in text.splitlines() if line.startswith(f"| `{section}.{name}` |")]
            assert len(rows) == 1, f"{section}.{name}: {len(rows)} rows"
            assert docs._cell(field.description) in rows[0]


def test_check_mode_reports_a_stale_file(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(docs.render() + "A line edited by hand.\n")
    assert docs.main(["--check", "--output", str(stale)]) == 1
    assert docs.main(["--output", str(stale)]) == 0
    assert docs.main(["--check", "--output", str(stale)]) == 0
