"""The package's sizes (STYLE.md): no module under slime_mt/ longer than 600 lines, no function longer than
80 (its def to its last line, docstring included). A module past the bound is asking to be split along a
seam you can name; a function past it, to be read as steps with names. Unit tier, about 0.3 s (the files
parsed, nothing imported)."""

import ast

from train_helpers import REPO

MODULE_LINES, FUNCTION_LINES = 600, 80


def sizes():
    """(module line counts over the bound, function line counts over the bound) of slime_mt, by path."""
    modules, functions = {}, {}
    for path in sorted((REPO / "slime_mt").rglob("*.py")):
        text, where = path.read_text(), str(path.relative_to(REPO))
        if len(text.splitlines()) > MODULE_LINES:
            modules[where] = len(text.splitlines())
        for node in ast.walk(ast.parse(text, where)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    functions[f"{where}:{node.lineno} {node.name}"] = lines
    return modules, functions


def test_no_module_over_600_lines_and_no_function_over_80():
    modules, functions = sizes()
    assert modules == {}, f"modules over {MODULE_LINES} lines: {modules}"
    assert functions == {}, f"functions over {FUNCTION_LINES} lines: {functions}"
