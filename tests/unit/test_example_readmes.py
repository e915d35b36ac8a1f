"""Every example's README (and the README and the docs pages) runs as written: each file it names under
examples/ and each --config it passes is shipped (issue 44 item 15: examples/custom_env's README named files
it did not ship).
Unit tier: reads the READMEs, well under a second."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
READMES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").glob("*/README.md"))]


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_an_example_readme_names_is_shipped(readme):
    text = readme.read_text()
    named = re.findall(r"examples/[\w./-]+\.(?:py|yaml|sh|md)", text)
    # an example's --config is its own file; the README's and the docs' are placeholders (my.yaml, RUN_DIR/...)
    configs = re.findall(r"--config\s+(\S+)", text) if readme.parent.parent == REPO / "examples" else []
    # a docs page links an example's page (examples/custom_env.md: its README, scripts/docs_hooks.py)
    site_page = re.compile(r"examples/(\w+)\.md") if REPO / "docs" in readme.parents else None
    shipped = [p for p in [*named, *configs] if (REPO / p).exists()]
    pages = [p for p in named if site_page and site_page.fullmatch(p) and (REPO / p[:-3] / "README.md").is_file()]
    missing = [p for p in [*named, *configs] if p not in shipped + pages]
    assert not missing, f"{readme.relative_to(REPO)} names files the repository does not ship: {missing}"
