"""Inside a sandbox: grade ``solution.py`` by hidden tests (standard library only: run as main.py).

The grade is not the exit code and not the output, which the graded code controls (``os._exit(0)``,
``SystemExit`` in an atexit hook, closing stdout, printing a marker). It is a per-run random token:
the sandbox writes it to a file with a random name beside the code, and this harness copies it to
the report channel (fd 3) only after every test passed, as the last thing the process does. The code
cannot read that file (every ``open`` of its name is refused), nor reach this harness's memory, so the
only way to report a pass is to pass. How, in order:

1. stdin (read to its end before the code runs): the tests and the token file's name.
2. Before the code runs: the modules the tests import are imported and copied (the tests see the
   copies, so a monkeypatched ``math.isclose`` does not reach them), the builtins are copied (the
   tests see these, so a redefined ``abs`` does not reach them either), and an audit hook is installed
   that the code cannot remove. It refuses: opening the token file or any ``/proc/*/mem``; frames and
   code objects (``sys._getframe``, ``tb_frame``, ``__code__``, ...), ``gc``'s object walks, tracing
   and profiling, more audit hooks, ``ctypes``, sub-interpreters, new processes and programs (fork,
   exec, spawn, subprocess), links and renames of the token file.
3. The code runs as the module ``solution`` (its ``if __name__ == "__main__"`` block does not run);
   a ``SystemExit`` it raises ends the code, not the grading.
4. Each top-level statement of the tests runs in a namespace of the code's names (those that do not
   shadow a builtin) with the copied builtins. Every value a test compares (``==``, ``<``, ``in``,
   ...), every assert's condition and every generator element (``all(f(x) for ...)``) must be plain
   data: None, bool, int, float, complex, str, bytes, and lists, tuples, dicts, sets of them, by exact
   type. An object whose ``__eq__`` always says True is refused, not trusted.
5. After the last test: one thread left, garbage collection off, every signal ignored; then the token
   file is opened (the hook allows it now), its token written to fd 3, and the process ends at once
   (no atexit hook, no finaliser runs after the tests).
"""

import ast
import builtins
import gc
import json
import os
import signal
import sys
import types

REPORT_FD = 3
PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)
PLAIN_CONTAINERS = (list, tuple, set, frozenset)
REFUSED_EVENTS = (
    "sys._getframe",
    "sys._current_frames",
    "sys.settrace",
    "sys.setprofile",
    "sys.addaudithook",
    "object.__getattr__",  # tb_frame, gi_frame, cr_frame, f_code, __code__: the way into frames
    "os.fork",
    "os.forkpty",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "subprocess.Popen",
    "os.link",
    "os.symlink",
    "code.__new__",
)
REFUSED_PREFIXES = ("gc.", "ctypes.", "sys.monitoring", "cpython.")
REFUSED_MODULES = ("_posixsubprocess", "_ctypes", "_xxsubinterpreters", "_xxinterpchannels", "_interpreters")


class GradingRefused(ValueError):
    """What the audit hook raises (a ValueError: the standard library's frame lookups fall back on it)."""


def plain(value):
    """``value`` when it is plain data (exact types, containers checked all the way down), else raise."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind in PLAIN_SCALARS:
            continue
        if kind in PLAIN_CONTAINERS:
            stack.extend(item)
        elif kind is dict:
            stack.extend(item.keys())
            stack.extend(item.values())
        else:
            raise AssertionError(f"a hidden test compared a {kind.__name__} value; only plain data is graded")
    return value


class PlainValues(ast.NodeTransformer):
    """Wrap what the tests compare or test for truth in ``__plain__(...)``."""

    @staticmethod
    def wrap(node: ast.expr) -> ast.expr:
        return ast.Call(func=ast.Name("__plain__", ast.Load()), args=[node], keywords=[])

    def truth(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.BoolOp):
            node.values = [self.truth(self.visit(v)) for v in node.values]
            return node
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            node.operand = self.truth(self.visit(node.operand))
            return node
        node = self.visit(node)
        return node if isinstance(node, ast.Compare) else self.wrap(node)

    def visit_Compare(self, node):
        self.generic_visit(node)
        node.left = self.wrap(node.left)
        node.comparators = [self.wrap(c) for c in node.comparators]
        return node

    def visit_Assert(self, node):
        node.test = self.truth(node.test)
        if node.msg is not None:
            node.msg = self.visit(node.msg)
        return node

    def visit_GeneratorExp(self, node):
        self.generic_visit(node)
        node.elt = self.wrap(node.elt)
        return node

    def visit_IfExp(self, node):
        self.generic_visit(node)
        node.test = self.truth(node.test)
        return node


def imported_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def copied_modules(names: set[str]) -> dict[str, types.ModuleType]:
    """Each module the tests import (and its parents), imported now and copied attribute by attribute."""
    copies = {}
    for name in sorted(names):
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            full = ".".join(parts[:depth])
            try:
                __import__(full)
            except ImportError:
                break  # the tests' own import fails the same way when it runs
            copy = types.ModuleType(full)
            copy.__dict__.update(sys.modules[full].__dict__)
            copies[full] = copy
    for full, copy in copies.items():  # a package's copy points at its submodules' copies
        parent, _, child = full.rpartition(".")
        if parent in copies:
            setattr(copies[parent], child, copy)
    return copies


def main() -> None:
    """Runs in a namespace of its own (see the end of the file): the names it looks up are not the
    ones the graded code can reach through ``__main__`` or ``builtins``; what it calls after the code
    ran was taken before (module attributes can be patched by the code)."""
    read, write, open_, exit_, listdir = os.read, os.write, os.open, os._exit, os.listdir
    mask, blocked = signal.pthread_sigmask, [int(n) for n in signal.valid_signals()]
    stop_gc, flush, stderr, report_fd, rdonly = gc.disable, sys.stdout.flush, sys.stderr, REPORT_FD, os.O_RDONLY
    chunks = []
    while chunk := read(0, 1 << 16):
        chunks.append(chunk)
    payload = json.loads(b"".join(chunks))
    grade_file = payload["grade_file"]
    statements = ast.parse(payload["tests"], "<hidden tests>").body
    del chunks, payload
    tests = [
        compile(
            ast.fix_missing_locations(PlainValues().visit(ast.Module([s], []))), "<hidden tests>", "exec", optimize=0
        )
        for s in statements
    ]
    modules = copied_modules(imported_names(ast.Module(statements, [])))
    del statements
    real_import = builtins.__import__

    def tests_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name in modules:
            return modules[name] if fromlist else modules[name.partition(".")[0]]
        return real_import(name, globals, locals, fromlist, level)

    pristine = dict(builtins.__dict__)
    armed = []

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path = args[0]
            if type(path) is int or armed:
                return
            if type(path) is bytes:
                path = bytes.decode(path, "utf-8", "surrogateescape")
            elif type(path) is not str:  # a str subclass or a path object could name another file when opened
                raise GradingRefused("the sandbox's grading opens files by str or bytes paths only")
            name = str.rpartition(path, "/")[2]
            if name == grade_file or name == "mem":
                raise GradingRefused(f"the sandbox's grading refuses to open {name}")
        elif event in REFUSED_EVENTS or str.startswith(event, REFUSED_PREFIXES):
            raise GradingRefused(f"the sandbox's grading refuses {event}")
        elif event == "import" and args[0] in REFUSED_MODULES:
            raise GradingRefused(f"the sandbox's grading refuses importing {args[0]}")
        elif event in ("os.rename", "os.remove"):
            for path in args[:2]:
                if type(path) is bytes:
                    path = bytes.decode(path, "utf-8", "surrogateescape")
                if type(path) is not str or grade_file in path:
                    raise GradingRefused(f"the sandbox's grading refuses {event} of its own file or by a path object")

    with open("solution.py", encoding="utf-8", errors="replace") as fh:
        source = fh.read()
    sys.addaudithook(hook)
    solution = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(source, "solution.py", "exec"), solution)
    except SystemExit:
        print("[the code raised SystemExit; the hidden tests run on what it defined]", file=stderr)
    except BaseException as e:
        print(f"the code failed before the tests: {type(e).__name__}: {e}", file=stderr)
        exit_(1)
    namespace = {k: v for k, v in solution.items() if k not in pristine and not k.startswith("__")}
    namespace.update(__builtins__={**pristine, "__import__": tests_import}, __plain__=plain, __name__="hidden_tests")
    for number, test in enumerate(tests, 1):
        try:
            exec(test, namespace)
        except BaseException as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            print(f"hidden test {number} of {len(tests)} failed: {why}", file=stderr)
            exit_(1)
    flush()  # the code's own stdout object may run code: before the checks below, not after
    mask(0, blocked)  # SIG_BLOCK: no signal handler of the code runs from here
    for _ in range(3):
        pass  # a handler already pending runs here, before the checks
    if len(listdir("/proc/self/task")) != 1:
        print("the code left threads running; it is not graded", file=stderr)
        exit_(1)
    stop_gc()  # no finaliser of the code's objects runs from here
    armed.append(True)
    fd = open_(grade_file, rdonly)
    write(report_fd, read(fd, 256))
    exit_(0)


if __name__ == "__main__":
    # run this file again in a namespace with builtins of its own, which the graded code cannot patch
    sealed = {"__name__": "grade_harness", "__builtins__": dict(builtins.__dict__)}
    with open(__file__, encoding="utf-8") as fh:
        exec(compile(fh.read(), __file__, "exec"), sealed)
    sealed["main"]()
