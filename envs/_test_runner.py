"""Inside the grading's own sandbox (standard library only: run as main.py, ``_plain_data.py`` beside it):
the hidden tests, run against a proxy of the model's solution, which runs in another sandbox.

First this process makes itself non-dumpable: no process of the same user can read its memory or its
descriptors or attach to it (the model's code, where it runs without namespaces as the same user, least
of all). Then, from stdin, one line ``{"tests": text, "names": [...]}``: the names the solution defines.
Each name the tests use that is neither a builtin nor theirs is bound to a proxy: a call writes
``{"call": name, "args": [...], "kwargs": {...}}`` (plain data) on the channel (fd 3) and reads the answer
from stdin (``_callee.py``'s, relayed by the host): a plain value, or the exception the solution raised,
raised here as the builtin exception of that name (else ``SolutionError``). The tests' top-level
statements run in turn; the first that raises fails the grading (``hidden test k of n failed: ...`` on
stderr, exit 1). Exit 0, the verdict, comes after the last one passed, and from nothing else: what the
solution answers is data that the tests compare here, where the solution's code never runs.
"""

import ast
import builtins
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's folder out
from _plain_data import PlainDataError, decode, dumps, encode, loads  # noqa: E402

CHANNEL_FD = 3
PR_SET_DUMPABLE = 4


class SolutionError(Exception):
    """The solution raised an exception that is not a builtin one, or did not answer."""


def send(message: dict) -> None:
    data = dumps(message)
    while data:
        data = data[os.write(CHANNEL_FD, data) :]


class Solution:
    """A name the solution defines, called across the pipe: plain data in, plain data out."""

    def __init__(self, name: str, answers):
        self.name, self.answers = name, answers

    def __repr__(self) -> str:
        return f"<the solution's {self.name}>"

    def __call__(self, *args, **kwargs):
        try:
            request = {"call": self.name, "args": encode(list(args)), "kwargs": encode(kwargs)}
        except PlainDataError as e:
            raise TypeError(f"{self.name}: the tests pass plain data to the solution ({e})") from None
        send(request)
        line = self.answers.readline()
        if not line:
            raise SolutionError(f"{self.name}: the solution ended without an answer")
        try:
            answer = loads(line)
            if "value" in answer:
                return decode(answer["value"])
        except (PlainDataError, TypeError) as e:
            raise SolutionError(f"{self.name}: an answer that is not plain data ({e})") from None
        kind = getattr(builtins, str(answer.get("raised")), None)
        message = str(answer.get("message", ""))
        if isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__ == "builtins":
            raise kind(message)
        raise SolutionError(f"{self.name} raised {answer.get('raised')}: {message}")


def used_names(tree: ast.Module) -> set[str]:
    """The names the tests read."""
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def main() -> None:
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    answers = sys.stdin.buffer
    setup = loads(answers.readline())
    tree = ast.parse(setup["tests"], "<hidden tests>")
    names = set(setup["names"]) & used_names(tree) - set(dir(builtins))
    namespace = {"__name__": "hidden_tests", **{name: Solution(name, answers) for name in names}}
    statements = tree.body
    for number, statement in enumerate(statements, 1):
        try:
            exec(compile(ast.Module([statement], []), "<hidden tests>", "exec"), namespace)
        except BaseException as e:  # noqa: BLE001 - every way a test can fail fails the grading
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            print(f"hidden test {number} of {len(statements)} failed: {why}", file=sys.stderr, flush=True)
            os._exit(1)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
