"""The tests a change reaches, for the local loop: ``bash scripts/test.sh --affected [REF]``.

    python scripts/affected.py [REF]                the test files to run, one per line (or a tier, or "all")
    python scripts/affected.py --changed FILE ...   the same for these changed files (no git)

A test file is selected when what it reaches touches a changed file. What a file reaches, read from the code
(nothing is imported; ``scripts/import_graph.py``'s reading of imports, every import inside a function
included): the project modules (``slime_mt``, ``rollouts``, ``envs``) and the test helpers
(``tests/helpers``) it imports, the modules and files its strings name (``"rollouts.multi_turn.generate"``,
``"envs/geo3k.py"``, ``"megatron_worker.py"``: a plug-in path, a script it starts), ``slime_mt.cli`` where it
starts ``slime-mt``, the fixtures of ``conftest.py`` it takes by name (their imports), and so on from each.

What it cannot tell runs everything: a change to ``setup.py``, ``pyproject.toml``, ``scripts/``, ``.ci/``,
a ``conftest.py`` or the tiers plugin, a file it cannot place, or no REF and no record of a green run. A
change to Markdown only runs the unit tier (its tests read the READMEs), and the docs site's test too when
the change is to the site's sources (``docs/``, ``mkdocs.yml``, an example's README). REF defaults to the merge base of
HEAD with the last commit whose whole suite passed, which ``scripts/test.sh`` records after a full green
run (``.git/slime-mt-last-green``). CI runs every tier regardless.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_graph  # noqa: E402

ROOT = import_graph.ROOT
TESTS = ROOT / "tests"
HELPERS = TESTS / "helpers"
RECORD = "slime-mt-last-green"  # under the git directory: the last commit whose whole suite passed
EVERYTHING = ("setup.py", "pyproject.toml", "scripts/", ".ci/", "tests/helpers/tiers.py")
DOCS_SITE_TEST = "tests/integration/docs/test_docs_site.py"  # what a change to the site's sources runs too
CLI_MARKS = ("slime_mt.cli", '"slime-mt"', "geo3k_train_cmd", "train_cmd(")
# names slime_mt.cli without starting it: the fork server forks the runs the tests ask for (every test
# imports it through tests/conftest.py; the tests that start slime-mt say so themselves)
NOT_A_START = {"forkserver"}


def known_files(root: Path = ROOT) -> dict[str, Path]:
    """Node name -> file: the project's modules (dotted), the helpers (dotted from tests/helpers), the test
    files and conftests (their paths)."""
    known = dict(import_graph.modules(root))
    helpers = root / "tests" / "helpers"
    for path in sorted(helpers.rglob("*.py")):
        parts = list(path.relative_to(helpers).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts and parts[0] != "slime_upstream":
            known[".".join(parts)] = path
    for path in sorted((root / "tests").rglob("*.py")):
        if helpers not in path.parents:
            known[str(path.relative_to(root))] = path
    return known


def _strings(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _named_by(text: str, known: dict[str, Path], by_path: dict[str, str], helper_files: dict[str, str]) -> set[str]:
    """The nodes a string names: a dotted module (or a function in one), a project file's path, a helper
    script's file name."""
    found = set()
    for word in text.replace(":", " ").replace("/", " / ").split():
        name = word.strip("'\",()")
        while name and name not in known and "." in name:  # a function of a module: the module
            name = name.rpartition(".")[0]
        if name in known:
            found.add(name)
    if ".py" in text:
        found |= {node for path, node in by_path.items() if path in text}
        found |= {node for file_name, node in helper_files.items() if file_name in text}
    return found


def _fixtures(conftest: Path, known: dict[str, Path], named) -> dict[str, set[str]]:
    """A conftest's fixtures: name -> what its body imports and names (the fixtures it takes included)."""
    tree = ast.parse(conftest.read_text(), str(conftest))
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("fixture" in ast.unparse(d) for d in node.decorator_list):
            module = ast.Module(body=node.body, type_ignores=[])
            edges = {i.target for i in _body_imports(module, known)}
            edges |= {n for s in _strings(module) for n in named(s)}
            out[node.name] = edges | {f"fixture:{a.arg}" for a in node.args.args}
    return out


def _body_imports(tree: ast.AST, known: dict[str, Path]) -> set[import_graph.Import]:
    return import_graph._imports_of("tests", Path("conftest.py"), known, tree)


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Node -> the nodes it reaches directly."""
    known = known_files(root)
    by_path = {str(p.relative_to(root)): n for n, p in known.items() if not n.startswith("tests/")}
    helper_files = {p.name: n for n, p in known.items() if p.parent == root / "tests" / "helpers"}
    named = lambda text: _named_by(text, known, by_path, helper_files)  # noqa: E731
    edges: dict[str, set[str]] = {}
    conftests = sorted((root / "tests").rglob("conftest.py"))
    for node, path in known.items():
        text = path.read_text()
        tree = ast.parse(text, str(path))
        package_module = node if not node.startswith("tests/") else "tests"
        found = import_graph._imports_of(package_module, path, known, tree)
        if path.name == "conftest.py":  # its fixtures' imports count for the tests that take them (below)
            edges[node] = {i.target for i in found if not i.nested}
            continue
        out = {i.target for i in found}
        if node in NOT_A_START:  # its imports only
            edges[node] = out - {node}
            continue
        out |= {n for s in _strings(tree) for n in named(s)}
        if any(mark in text for mark in CLI_MARKS):  # it starts slime-mt: the command's own path
            if '"serve"' in text and '"train"' not in text and "train_cmd" not in text:  # the engine's server
                out.discard("slime_mt.cli")
                out.add("cli:serve")
            else:
                out.add("slime_mt.cli")
        if node.startswith("tests/") and path.name != "conftest.py":
            args = {a.arg for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for a in f.args.args}
            out |= {f"fixture:{a}" for a in args}
            out |= {str(c.relative_to(root)) for c in conftests if c.parent in path.parents}
        edges[node] = out - {node}
    cli = import_graph._imports_of("slime_mt.cli", known["slime_mt.cli"], known)
    edges["cli:serve"] = {i.target for i in cli if not i.nested} | {"slime_mt.engine.embedded.server"}
    for conftest in conftests:
        for name, reached in _fixtures(conftest, known, named).items():
            edges.setdefault(f"fixture:{name}", set()).update(reached)
    return edges


def node_of(changed: str, known: dict[str, Path], root: Path = ROOT) -> str | None:
    """The graph node a changed file is (None: a file the graph does not hold)."""
    path = root / changed
    return next((name for name, file in known.items() if file == path), None)


def select(changed: list[str], root: Path = ROOT, edges: dict[str, set[str]] | None = None) -> list[str] | str:
    """The test files a change reaches (sorted), or ``"all"``, or ``"unit"`` (Markdown only); ``edges``:
    ``graph(root)``, when already read."""
    changed = [c for c in changed if c]
    if not changed:
        return []
    site = [DOCS_SITE_TEST] if any(map(in_docs_site, changed)) else []
    if all(c.endswith(".md") or in_docs_site(c) for c in changed):
        return ["tests/unit", *site] if site else "unit"
    edges, known = edges if edges is not None else graph(root), known_files(root)
    targets = set()
    for c in changed:
        if c.endswith(".md") or in_docs_site(c):
            continue
        if c.startswith(EVERYTHING) or c.endswith("conftest.py"):
            return "all"
        node = node_of(c, known, root)
        if node is None:
            folder = str(Path(c).parent).replace("/", ".")
            owners = [n for n in edges if n == folder or n.startswith(folder + ".")]
            if not owners:  # a data file of a module folder counts as that folder's modules
                return "all"
            targets |= set(owners)
        else:
            targets.add(node)
    tests = [n for n in edges if n.startswith("tests/") and Path(n).name.startswith("test_")]
    return sorted({*site, *(n for n in tests if import_graph._reach(n, edges) & targets)})


def in_docs_site(path: str) -> bool:
    """A file the docs site is built from: its pages and pictures, its config, an example's README."""
    return (
        path.startswith("docs/") or path == "mkdocs.yml" or re.fullmatch(r"examples/\w+/README\.md", path) is not None
    )


def changed_since(ref: str | None) -> list[str] | None:
    """Files changed since ``ref`` (default: the merge base with the last green commit), the work tree and
    untracked files included; None when there is no ref to compare with."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    if ref is None:
        record = Path(git("rev-parse", "--git-path", RECORD).strip())
        record = record if record.is_absolute() else ROOT / record
        if not record.is_file():
            return None
        ref = git("merge-base", record.read_text().strip(), "HEAD").strip()
    files = git("diff", "--name-only", ref).split() + git("ls-files", "--others", "--exclude-standard").split()
    return sorted(set(files))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ref", nargs="?", default=None)
    parser.add_argument("--changed", nargs="+", default=None, help="these changed files, instead of git's")
    ns = parser.parse_args(argv)
    changed = ns.changed if ns.changed is not None else changed_since(ns.ref)
    if changed is None:
        print("all")
        print("affected: no REF and no record of a green run: every test", file=sys.stderr)
        return 0
    chosen = select(changed)
    if isinstance(chosen, str):
        print(chosen)
        print(f"affected: {len(changed)} changed file(s): {chosen}", file=sys.stderr)
    else:
        print("\n".join(chosen))
        print(f"affected: {len(changed)} changed file(s) reach {len(chosen)} test file(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
