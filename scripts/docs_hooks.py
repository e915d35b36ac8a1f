"""MkDocs hook of the docs site (``mkdocs.yml``): each example's page is its own README
(``examples/custom_env/README.md`` is the page ``examples/custom_env.md``), added to the site when it builds,
so the README is the one copy."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def on_files(files, config):
    for readme in sorted(EXAMPLES.glob("*/README.md")):
        text = readme.read_text()
        note = f"\n\n*This page is `examples/{readme.parent.name}/README.md`; the example's files are beside it.*\n"
        files.append(File.generated(config, f"examples/{readme.parent.name}.md", content=text + note))
    return files
