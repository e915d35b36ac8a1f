"""README's Flags table against the config (issue 70, until the docs generate it): every config field's
flag is listed once, under its group, and none that is not a field; every field has help text (what
``--help`` and the table's reader see). Unit tier: reads README.md (well under a second)."""

import collections
import re
from pathlib import Path

from slime_mt.config import FIELDS, REGISTERED, flag_name

README = Path(__file__).resolve().parents[2] / "README.md"


def table_rows() -> list[tuple[str, str]]:
    text = README.read_text()
    section = text[text.index("### Flags") : text.index("## Performance")]
    return re.findall(r"^\| (\w+) \| `(--[a-z0-9-]+)`", section, re.M)


def test_every_config_field_is_in_the_flags_table_once_under_its_group():
    rows = table_rows()
    groups = {flag_name(name): REGISTERED[name][0] for name in FIELDS}
    listed = collections.Counter(flag for _, flag in rows)
    assert sorted(set(groups) - set(listed)) == []  # a field added without its row
    assert sorted(set(listed) - set(groups)) == []  # a row left after its field went
    assert [flag for flag, count in listed.items() if count > 1] == []
    assert [(group, flag) for group, flag in rows if groups[flag] != group] == []


def test_every_config_field_has_help_text():
    assert [name for name in FIELDS if not REGISTERED[name][1].metadata.get("help", "").strip()] == []
