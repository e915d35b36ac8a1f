"""The project's import graph, read from the code (nothing is imported): its circles, its floors, and why
each import inside a function is there.

    python scripts/import_graph.py          the summary and every import inside a function, with its why
    python scripts/import_graph.py --check  exit 1 when a rule below is broken (tests/unit/test_import_graph.py)

Modules: every ``.py`` of ``slime_mt``, ``rollouts`` and ``envs``. An import is an arrow from the importing
module to the project module it names (``from a import b`` names ``a.b`` when that is a module, else
``a``), wherever it stands: at module level, inside a function, or under ``TYPE_CHECKING``. Rooms: the
modules directly under ``slime_mt/`` one each, a folder under ``slime_mt/`` one room, ``rollouts`` and
``envs`` one each; a room's floor is one above the highest room it imports.

The rules (``--check``):
  * no circle of modules, and no circle of rooms (so no arrow runs back up a floor);
  * the config package (``slime_mt/config``) imports nothing of the project but ``slime_mt/errors.py``;
    ``slime_mt`` imports nothing of ``envs`` or
    ``rollouts`` (user-facing packages built on it); the engines (``slime_mt/engine``) import nothing of the
    trainer (``slime_mt/backends``): what both use lies below both;
  * an import inside a function has a why: it defers a costly package (``COSTLY``) that its module does
    not load already, or its target reaches back to its module through module-level imports (it dodges a
    loop; at most ``MAX_LOOP_DODGES`` of those).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("slime_mt", "rollouts", "envs")
# third-party packages whose import costs a process a tenth of a second or more (torch 1.8 s,
# megatron.core 4 s on top, transformers' processing 1.7 s, ray 0.6 s, uvicorn and starlette 0.15 s, ...),
# or that need not be installed (wandb, sglang, reasoning_gym, openenv)
COSTLY = frozenset(
    "torch megatron ray transformers vllm sglang uvicorn starlette safetensors PIL numpy openai wandb httpx "
    "math_verify reasoning_gym openenv pyarrow datasets tokenizers jinja2 psutil".split()
)
MAX_LOOP_DODGES = 20


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the project module it names
    line: int
    nested: bool  # inside a function
    typing_only: bool  # under TYPE_CHECKING


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(known: dict[str, Path]) -> list[Import]:
    """Every import of a project module by a project module (one per target and line)."""
    found: set[Import] = set()
    for module, path in known.items():
        found |= _imports_of(module, path, known)
    return sorted(found, key=lambda i: (i.source, i.line, i.target))


def _imports_of(module: str, path: Path, known: dict[str, Path], tree: ast.AST | None = None) -> set[Import]:
    """The project imports of ``module`` (its file ``path``, or ``tree`` when already parsed)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[Import] = set()

    def visit(node: ast.AST, nested: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            for name in names:
                target = _resolve(name, known)
                if target is not None and target != module:
                    found.add(Import(module, target, child.lineno, nested, typing_only))
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            guarded = typing_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            visit(child, inner, guarded)

    visit(ast.parse(path.read_text(), str(path)) if tree is None else tree, False, False)
    return found


def third_party(path: Path, known: dict[str, Path]) -> set[str]:
    """The costly packages a module imports at module level."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        body = node.body if isinstance(node, ast.Try) else [node]
        for stmt in body:
            if isinstance(stmt, ast.Import):
                found |= {a.name.split(".")[0] for a in stmt.names}
            elif isinstance(stmt, ast.ImportFrom) and not stmt.level and stmt.module:
                found.add(stmt.module.split(".")[0])
    return found & COSTLY


def room(module: str, known: dict[str, Path], root: Path = ROOT) -> str:
    parts = known[module].relative_to(root).parts
    if parts[0] != "slime_mt":
        return parts[0]
    return "/".join(parts[:2]) if len(parts) > 2 else parts[-1] if len(parts) == 2 else "slime_mt"


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _reach(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@dataclass
class Report:
    modules: int
    imports: int
    nested: list[tuple[Import, str]]  # each import inside a function with its why ("" when it has none)
    module_circles: list[list[str]]
    room_circles: list[list[str]]
    floors: dict[str, int]
    broken: list[str]  # the rules broken, one line each


def analyse(root: Path = ROOT) -> Report:
    known = modules(root)
    found = imports(known)
    everything: dict[str, set[str]] = defaultdict(set)
    module_level: dict[str, set[str]] = defaultdict(set)
    rooms: dict[str, set[str]] = defaultdict(set)
    for i in found:
        everything[i.source].add(i.target)
        if not i.nested and not i.typing_only:
            module_level[i.source].add(i.target)
        if room(i.source, known, root) != room(i.target, known, root):
            rooms[room(i.source, known, root)].add(room(i.target, known, root))
    costly = {m: third_party(p, known) for m, p in known.items()}

    def loads(module: str) -> set[str]:
        return set().union(*(costly[m] for m in _reach(module, module_level)))

    nested = []
    for i in found:
        if not i.nested:
            continue
        deferred = sorted(loads(i.target) - loads(i.source))
        if i.source in _reach(i.target, module_level):
            why = "dodges a loop: " + " -> ".join([i.target, "...", i.source])
        elif deferred:
            why = "defers " + ", ".join(deferred)
        else:
            why = ""
        nested.append((i, why))
    module_circles = circles(everything)
    room_circles = circles(rooms)
    floors: dict[str, int] = {}

    def floor(r: str, path: tuple = ()) -> int:
        if r not in floors:
            below = [floor(t, (*path, r)) for t in rooms.get(r, ()) if t not in path]
            floors[r] = 1 + max(below, default=0)
        return floors[r]

    for r in {room(m, known, root) for m in known}:
        floor(r)
    broken = [f"a circle of modules: {' -> '.join(c)}" for c in module_circles]
    broken += [f"a circle of rooms (an arrow runs back up): {' -> '.join(c)}" for c in room_circles]
    broken += [
        f"{i.source}:{i.line} imports {i.target}: the config package imports nothing of the project but its errors"
        for i in found
        if _in_package(i.source, "slime_mt.config") and not _in_package(i.target, "slime_mt.config")
        and i.target != "slime_mt.errors"
    ]  # fmt: skip
    broken += [
        f"{i.source}:{i.line} imports {i.target}: slime_mt does not import envs or rollouts"
        for i in found
        if i.source.startswith("slime_mt") and i.target.split(".")[0] in ("envs", "rollouts")
    ]
    broken += [
        f"{i.source}:{i.line} imports {i.target}: the engines import nothing of the trainer"
        for i in found
        if i.source.startswith("slime_mt.engine") and i.target.startswith("slime_mt.backends")
    ]
    broken += [f"{i.source}:{i.line} imports {i.target} inside a function for no reason: import it at the top"
               for i, why in nested if not why]  # fmt: skip
    dodges = [i for i, why in nested if why.startswith("dodges")]
    if len(dodges) > MAX_LOOP_DODGES:
        broken.append(f"{len(dodges)} imports inside functions dodge a loop (at most {MAX_LOOP_DODGES})")
    return Report(len(known), len(found), nested, module_circles, room_circles, floors, broken)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a rule is broken")
    args = parser.parse_args(argv)
    report = analyse()
    dodges = sum(why.startswith("dodges") for _, why in report.nested)
    print(
        f"{report.modules} modules, {report.imports} imports ({len(report.nested)} inside functions, "
        f"{dodges} of them dodging a loop); circles: {len(report.module_circles)} of modules, "
        f"{len(report.room_circles)} of rooms"
    )
    for floor in sorted(set(report.floors.values()), reverse=True):
        print(f"floor {floor:2d}: {', '.join(sorted(r for r, f in report.floors.items() if f == floor))}")
    if not args.check:
        print("\nimports inside functions:")
        for i, why in report.nested:
            print(f"  {i.source}:{i.line} -> {i.target}: {why or 'NO REASON'}")
    for line in report.broken:
        print(f"BROKEN: {line}", file=sys.stderr)
    return 1 if args.check and report.broken else 0


if __name__ == "__main__":
    sys.exit(main())
