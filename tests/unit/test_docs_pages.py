"""The docs pages made from the code (issue 70 item 3): the committed flags reference and code map are what
``scripts/docs_pages.py`` makes from the code today, the flags reference lists every config field once
under its group with its default and help text, a field without help text fails, and every module the code
map lists has a docstring. Unit tier: imports the config and parses the project's modules (about a second)."""

import copy
import importlib.util
import re
from pathlib import Path

import pytest

from slime_mt.config import FIELDS, flag_name

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("docs_pages", REPO / "scripts/docs_pages.py")
docs_pages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_pages)


def test_the_committed_pages_are_what_the_code_makes():
    for name, text in docs_pages.pages().items():
        committed = (REPO / "docs" / name).read_text()
        assert committed == text, f"docs/{name} is out of date: run python scripts/docs_pages.py"


def test_the_flags_reference_lists_every_config_field_once_under_its_group():
    page = docs_pages.flags_page()
    rows = re.findall(r"^\| `(--[a-z0-9-]+)`", page, re.M)
    assert sorted(rows) == sorted(flag_name(name) for name in FIELDS)  # 209 today, each once
    where = {}
    group = None
    for line in page.splitlines():
        group = line[3:] if line.startswith("## ") else group
        flag = re.match(r"^\| `(--[a-z0-9-]+)`", line)
        if flag:
            where[flag.group(1)] = group
    assert where == {flag_name(name): FIELDS[name][0] for name in FIELDS}
    # its default and slime's column, read from the field and config/provenance.py
    assert "| `--eps-clip` | `0.2` | yes | PPO clip range (low side). |" in page
    assert "| `--eps-clip-high` | None | yes |" in page


def test_a_field_without_help_text_fails(monkeypatch):
    assert [name for name in FIELDS if not FIELDS[name][1].metadata.get("help", "").strip()] == []
    group, bare = FIELDS["eps_clip"][0], copy.copy(FIELDS["eps_clip"][1])
    bare.metadata = {"help": " "}
    monkeypatch.setitem(FIELDS, "eps_clip", (group, bare))
    with pytest.raises(ValueError, match="config field eps_clip .--eps-clip. has no help text"):
        docs_pages.flags_page()


def test_every_module_of_the_code_map_has_a_docstring():
    missing = [path for room in docs_pages.ROOMS for path, doc in docs_pages.modules(room) if not doc.strip()]
    assert missing == []
