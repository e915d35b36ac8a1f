"""Inside the model's sandbox (standard library only: run as main.py, ``_plain_data.py`` beside it): the
model's ``solution.py`` answering calls.

The solution runs as the module ``solution`` (its ``if __name__ == "__main__"`` block does not run; a
``SystemExit`` it raises ends it, and what it defined is served). Then, on the channel (fd 3), one line:
``{"ready": [names]}`` (its module-level functions and classes) or ``{"failed": why}``; and for each call
read from stdin, ``{"call": name, "args": [...], "kwargs": {...}}`` in plain data, one answer:
``{"value": v}`` or ``{"raised": exception type, "message": text}``.

Nothing of the grading is here: the tests, what they expect and the verdict live in another process
(``_test_runner.py``, in a sandbox of its own), which sees only the answers, as plain data. This script
runs in the model's process, so the model can change what it answers; it cannot change what the answers
are compared with, or how.
"""

import inspect
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's folder out
from _plain_data import PlainDataError, decode, dumps, encode, loads  # noqa: E402

CHANNEL_FD = 3


def send(message: dict) -> None:
    data = dumps(message)
    while data:
        data = data[os.write(CHANNEL_FD, data) :]


def load_solution() -> dict | None:
    """The solution's namespace (None: it failed, said on the channel)."""
    namespace = {"__name__": "solution", "__file__": "solution.py"}
    try:
        with open("solution.py", encoding="utf-8", errors="replace") as fh:
            source = fh.read()
        exec(compile(source, "solution.py", "exec"), namespace)
    except SystemExit:
        print("[the code raised SystemExit; the tests run on what it defined]", file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - every way the code can fail is the code's
        traceback.print_exc()
        send({"failed": f"{type(e).__name__}: {e}"[:1000]})
        return None
    return namespace


def answer(namespace: dict, request: dict) -> dict:
    """One call's answer: the value it returned, or the exception it raised (named), in plain data."""
    try:
        function = namespace[request["call"]]
        value = function(*decode(request.get("args", [])), **decode(request.get("kwargs", {"d": []})))
        return {"value": encode(value)}
    except PlainDataError as e:
        return {"raised": "TypeError", "message": f"the solution returned {e}"}
    except BaseException as e:  # noqa: BLE001 - the test decides what an exception means
        return {"raised": type(e).__name__, "message": str(e)[:1000]}


def main() -> None:
    # the calls come on what was stdin; the solution reads an empty one (a module-level input() ends)
    requests = os.fdopen(os.dup(0), "rb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    namespace = load_solution()
    if namespace is None:
        return
    names = [
        k for k, v in namespace.items() if not k.startswith("__") and (inspect.isfunction(v) or inspect.isclass(v))
    ]
    send({"ready": names})
    for line in requests:
        try:
            request = loads(line)
        except PlainDataError as e:
            send({"raised": "TypeError", "message": str(e)})
            continue
        send(answer(namespace, request))


if __name__ == "__main__":
    main()
