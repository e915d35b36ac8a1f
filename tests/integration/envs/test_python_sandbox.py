"""The code environment (envs/python_sandbox.py) and its grading, which the model's code cannot reach:
the hidden tests run in a process of their own against a proxy of the solution (plain data both ways),
so no exit, output, patch, object, signal, thread or search of the code earns a reward its answers do not
earn, in both sandbox modes; right solutions import what they like; program tests compare outputs.
Integration tier, about 90 s (two sandboxes a grading, two modes)."""

import argparse
import asyncio
from textwrap import dedent

import pytest
from sandbox_helpers import ISOLATED, LIMITS, NO_USERNS, run

import envs.sandbox as sandbox
from envs.python_sandbox import PythonSandboxEnv, build_env, code_block, grade
from envs.sandbox import SandboxLimits
from slime_mt.errors import InvalidActionError
from slime_mt.types import Sample

needs_isolation = pytest.mark.skipif(not ISOLATED, reason=NO_USERNS)


@needs_isolation  # the env's default: no model code without isolation
def test_the_code_env_runs_turns_and_grades_with_hidden_tests():
    env = build_env(Sample(metadata={"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"}))
    assert isinstance(env, PythonSandboxEnv)
    observation, done, info = asyncio.run(env.step("Try:\n```python\nprint(1 + 1)\n```"))
    assert observation == {"text": "2"} and not done and info["exit_code"] == 0
    observation, done, info = asyncio.run(env.step("```python\ndef add(a, b):\n    return a - b\n```<submit>"))
    assert done and info["reward"] == 0.0 and "AssertionError" in observation["text"]
    env = build_env(Sample(metadata={"tests": "assert add(2, 3) == 5"}))
    _, done, info = asyncio.run(env.step("```python\ndef add(a, b):\n    return a + b\n```\n<submit>"))
    assert done and info["reward"] == 1.0
    with pytest.raises(InvalidActionError, match="python block"):
        asyncio.run(env.step("no code here"))
    assert code_block("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```") == "y = 2"
    with pytest.raises(ValueError, match="metadata\\['tests'\\]"):
        build_env(Sample(metadata={}))
    # with --max-turns 2 the second valid turn is the last: it is graded without <submit>
    env = build_env(Sample(metadata={"tests": "assert add(2, 3) == 5"}), argparse.Namespace(max_turns=2))
    _, done, info = asyncio.run(env.step("```python\nprint(7)\n```"))
    assert not done and info == {"timed_out": 0.0, "exit_code": 0, "isolated": float(ISOLATED)}
    observation, done, info = asyncio.run(env.step("```python\ndef add(a, b):\n    return a + b\n```"))
    assert done and info["reward"] == 1.0 and info["passed"] == 1.0


# ---------------------------------------------------------------- grading the model's code cannot reach (issue 67, 1)

HIDDEN = """assert add(2, 3) == 5
assert add(-1, 1) == 0
import math
assert math.isclose(add(0.1, 0.2), 0.3)
assert abs(add(1, 1) - 2) < 1e-9
assert all(add(x, x) == 2 * x for x in range(3))
assert add(2, 2)
"""
RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
# a solution that turns right once it has seen the hidden tests anywhere: the hacks that look for them
# feed what they find to look(); any leak of the tests into what the model's code can read passes them
ORACLE = """import glob, os, re
LEAKED = False
def look(data):
    global LEAKED
    data = data if isinstance(data, bytes) else str(data).encode(errors="ignore")
    LEAKED = LEAKED or b"add(2, 3) =" + b"= 5" in data  # written so that its own source does not match
def read(path, limit=1 << 20):
    try:
        with open(path, "rb") as fh:
            return fh.read(limit)
    except OSError:
        return b""
def pids():
    return [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
def graders():
    \"\"\"The processes that grade this one: its parents, and every sandbox's (the tests' among them).\"\"\"
    chain, pid = set(), os.getppid()
    while pid > 1:
        chain.add(str(pid))
        pid = int(read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[1] or 0)
    sandboxes = {p for p in pids() if any(m in read(f"/proc/{p}/cmdline") for m in (b"_plain_data", b"main.py"))}
    return chain | sandboxes
def memory(pid):
    for line in read(f"/proc/{pid}/maps").splitlines():
        span, perms = line.split()[:2]
        if not perms.startswith(b"r"):
            continue
        start, end = (int(x, 16) for x in span.split(b"-"))
        try:
            with open(f"/proc/{pid}/mem", "rb") as fh:
                fh.seek(start)
                look(fh.read(min(end - start, 1 << 24)))
        except (OSError, ValueError, OverflowError):
            pass
def add(a, b):
    return a + b if LEAKED else a - b
"""
HACKS = {  # a wrong solution (add subtracts) with each trick; the code in each entry is what the model wrote
    # the process's end and output: the verdict is the tests' exit status, never the solution's
    "os._exit(0)": WRONG + "import os\nos._exit(0)",
    "sys.exit(0)": WRONG + "import sys\nsys.exit(0)",
    "SystemExit(0) in an atexit hook": WRONG
    + dedent("""
        import atexit, sys
        atexit.register(lambda: sys.exit(0))
        raise SystemExit(0)
    """),
    "a kill of itself with a clean status": WRONG
    + dedent("""
        import os, signal
        signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
        os.kill(os.getpid(), signal.SIGTERM)
    """),
    "closing stdout and stderr": WRONG + "import os\nos.close(1)\nos.close(2)",
    "printing a success marker": WRONG + "print('All tests passed. OK')\nprint('hidden test 7 of 7 passed')",
    "forged answers on the channel": WRONG + "import os\nos.write(3, b'{\"value\": 5}\\n' * 64)",
    "a forged readiness naming the builtins": WRONG
    + dedent("""
        import os
        os.write(3, b'{"ready": ["abs", "all", "math", "AssertionError", "add"]}\\n')
    """),
    "forged answers from a thread left running": WRONG
    + dedent("""
        import os, threading, time
        def forge():
            while True:
                os.write(3, b'{"value": true}\\n')
                time.sleep(0.001)
        threading.Thread(target=forge, daemon=True).start()
    """),
    # objects that claim equality or arithmetic: only plain data crosses
    "an object equal to everything": dedent("""
        class Any:
            __eq__ = lambda s, o: True
            __lt__ = lambda s, o: True
            __bool__ = lambda s: True
            __sub__ = lambda s, o: s
            __abs__ = lambda s: s
        def add(a, b):
            return Any()
    """),
    "an int subclass equal to everything": dedent("""
        class Int(int):
            __eq__ = lambda s, o: True
            __lt__ = lambda s, o: True
            __hash__ = int.__hash__
            __sub__ = lambda s, o: s
            __abs__ = lambda s: 0
        def add(a, b):
            return Int(a - b)
    """),
    "a __sub__ of itself and an __abs__ of 0.0": dedent("""
        class X:
            __sub__ = lambda s, o: s
            __abs__ = lambda s: 0.0
            __eq__ = lambda s, o: True
            __bool__ = lambda s: True
        def add(a, b):
            return X()
    """),
    "a float subclass with a lying __eq__": dedent("""
        class F(float):
            __eq__ = lambda s, o: True
            __hash__ = float.__hash__
        def add(a, b):
            return F(a - b)
    """),
    "a list subclass equal to everything": dedent("""
        class L(list):
            __eq__ = lambda s, o: True
        def add(a, b):
            return L([a - b])
    """),
    "a generator": "def add(a, b):\n    return (x for x in [a + b])",
    "a callable": "def add(a, b):\n    return lambda *x: a + b",
    "an answer too deep to decode": dedent("""
        def add(a, b):
            x = a + b
            for _ in range(150):
                x = [x]
            return x
    """),
    # what the old harness shared with the code (its namespace, builtins, modules, frames, objects): here
    # they are the code's own process's, and the tests are not in it
    "redefined builtins": WRONG
    + dedent("""
        import builtins
        builtins.abs = lambda x: 0
        builtins.all = lambda xs: True
        class AssertionError(Exception):
            pass
        builtins.AssertionError = AssertionError
    """),
    "a monkeypatched module the tests use": WRONG + "import math\nmath.isclose = lambda *a, **k: True",
    "patched os.path and json's decoder": WRONG
    + dedent("""
        import json, os
        os.path.exists = lambda p: True
        json._default_decoder.decode = lambda s, *a: {"value": 5}
    """),
    "a patched callee through __main__": WRONG
    + dedent("""
        import __main__
        __main__.answer = lambda ns, request: {"value": True}
        __main__.encode = lambda v: True
    """),
    "the harness's names through __main__": WRONG
    + dedent("""
        import __main__
        for name in ("exec", "plain", "type", "REFUSED_EVENTS", "send", "loads"):
            setattr(__main__, name, lambda *a, **k: None)
    """),
    "the caller's frames": WRONG + "import sys\nprint(sys._getframe(1).f_locals)",
    "frames through a traceback": WRONG
    + dedent("""
        try:
            1 / 0
        except ZeroDivisionError as e:
            print(e.__traceback__.tb_frame.f_back.f_locals)
    """),
    "walking every object": WRONG
    + "import gc\nprint([o for o in gc.get_objects() if isinstance(o, str) and 'assert' in o])",
    "ctypes on its own memory": WRONG + "import ctypes\nctypes.memset(id(1) + 24, 0, 1)",
    "reading its own memory": WRONG + "print(open('/proc/self/mem', 'rb').read(1))",
    "an audit hook of its own": WRONG + "import sys\nsys.addaudithook(lambda *a: None)",
    "a fresh interpreter": WRONG
    + "import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import os; os._exit(0)'])",
    "a SIGALRM that swaps the answer": dedent("""
        import signal
        SWAP = [lambda a, b: a - b]
        signal.signal(signal.SIGALRM, lambda *x: SWAP.append(lambda a, b: a + b))
        signal.setitimer(signal.ITIMER_REAL, 0.0005)
        def add(a, b):
            return SWAP[0](a, b)
    """),
    # the tests and a verdict looked for wherever the code can read: none is there
    "the PID 1 command line": ORACLE + "look(read('/proc/1/cmdline'))",
    "every process's command line": ORACLE + "for p in pids():\n    look(read(f'/proc/{p}/cmdline'))",
    "every process's environment": ORACLE + "look(os.environ)\nfor p in pids():\n    look(read(f'/proc/{p}/environ'))",
    "the memory of the processes that grade it": ORACLE + "for p in graders():\n    memory(p)",
    "the files of every sandbox's folder and its own": ORACLE
    + dedent("""
        for path in glob.glob('/tmp/slime-mt-sandbox-*/**', recursive=True) + glob.glob('**', recursive=True):
            look(read(path))
    """),
    "opening files from Rust": ORACLE
    + dedent("""
        import tokenizers
        for path in glob.glob('/tmp/slime-mt-sandbox-*/*'):
            try:
                look(repr(tokenizers.models.WordPiece.read_file(path)))
            except Exception:
                pass
    """),
    "a forged answer into the tests' pipes": WRONG
    + dedent("""
        import os
        for p in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:
            try:
                fds = os.listdir(f'/proc/{p}/fd')
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f'/proc/{p}/fd/{fd}').startswith('pipe:'):
                        with open(f'/proc/{p}/fd/{fd}', 'wb', buffering=0) as w:
                            w.write(b'{"value": true}\\n' * 8)
                except OSError:
                    pass
    """),
    "killing the tests' process": WRONG
    + dedent("""
        import os, signal
        for p in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:
            try:
                if b'_plain_data' in open(f'/proc/{p}/cmdline', 'rb').read():
                    os.kill(int(p), signal.SIGKILL)
            except OSError:
                pass
    """),
}


def test_the_oracle_would_pass_on_what_it_finds():
    """The hacks that look for the tests are not blind: given the tests, the oracle passes them."""
    _, passed = asyncio.run(grade(ORACLE + f"look({HIDDEN!r})", HIDDEN, LIMITS))
    assert passed == 1.0


@pytest.mark.parametrize("hack", HACKS)
def test_a_reward_hack_earns_nothing(mode, hack):
    """Each of the hacks with a wrong solution is graded 0 (isolated, and without namespaces)."""
    assert len(HACKS) >= 30
    result, passed = asyncio.run(grade(HACKS[hack], HIDDEN, LIMITS))
    assert passed == 0.0, (hack, result)


RIGHTS = {  # right solutions that import or do what the old harness refused
    "numpy": "import numpy as np\ndef add(a, b):\n    return np.add(a, b)",
    "logging": "import logging\nlogging.basicConfig(level=logging.DEBUG)\nlog = logging.getLogger('s')\n"
    "def add(a, b):\n    log.debug('adding %s and %s', a, b)\n    return a + b",
    "asyncio": "import asyncio\nasync def _add(a, b):\n    await asyncio.sleep(0)\n    return a + b\n"
    "def add(a, b):\n    return asyncio.run(_add(a, b))",
    "concurrent.futures": "from concurrent.futures import ThreadPoolExecutor\npool = ThreadPoolExecutor(2)\n"
    "def add(a, b):\n    return pool.submit(lambda: a + b).result()",
    "traceback.format_exc": "import traceback\ndef add(a, b):\n    try:\n        raise ValueError('x')\n"
    "    except ValueError:\n        traceback.format_exc()\n    return a + b",
    "an exit and a closed stdout after defining it": RIGHT + "import os, sys\nos.close(1)\nsys.exit(0)",
    "an audit hook of its own": RIGHT + "import sys\nsys.addaudithook(lambda *a: None)",
    "the frames and gc it likes": RIGHT + "import gc, sys\ngc.collect()\nsys._getframe(0).f_locals",
}


@pytest.mark.parametrize("right", RIGHTS)
def test_a_right_solution_earns_the_reward_whatever_it_imports(mode, right):
    result, passed = asyncio.run(grade(RIGHTS[right], HIDDEN, LIMITS))
    assert passed == 1.0, (right, result)


def test_humaneval_checks_and_raised_exceptions_are_graded_as_before(mode):
    """HumanEval's form (a check(candidate) the tests call with the solution), and a test that expects
    the solution to raise: the exception crosses as the builtin it is."""
    check = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\ncheck(add)\n"
    assert asyncio.run(grade(RIGHT, check, LIMITS))[1] == 1.0
    assert asyncio.run(grade(WRONG, check, LIMITS))[1] == 0.0
    raises = "try:\n    add(1, 'a')\n    assert False\nexcept TypeError:\n    pass\nassert add((1,), (2,)) == (1, 2)\n"
    assert asyncio.run(grade(RIGHT, raises, LIMITS))[1] == 1.0
    result, passed = asyncio.run(grade("def add(a, b):\n    return str(a) + str(b)", raises, LIMITS))
    assert passed == 0.0 and "hidden test 1 of 2 failed: AssertionError" in result.stderr


PROGRAM_TESTS = [{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2", "output": "8"}]


def test_program_tests_compare_the_output_here(mode):
    """stdin to stdout: the program runs on each input in the sandbox; its output is compared by the
    host, white space at line ends aside; printing, exiting or a marker earns nothing more."""
    right = "a, b = map(int, input().split())\nprint(a + b)   \n\n"
    assert asyncio.run(grade(right, PROGRAM_TESTS, LIMITS))[1] == 1.0
    for wrong in (
        "a, b = map(int, input().split())\nprint(a - b)",
        "import os\nprint('7')\nos._exit(0)",
        "print('OK')",
    ):
        result, passed = asyncio.run(grade(wrong, PROGRAM_TESTS, LIMITS))
        assert passed == 0.0 and "failed: wrong output" in result.stderr, wrong
    result, passed = asyncio.run(grade("import sys\nprint(7)\nsys.exit(1)", PROGRAM_TESTS, LIMITS))
    assert passed == 0.0 and "hidden test 1 of 2 failed: the program did not end cleanly" in result.stderr
    env = build_env(
        Sample(metadata={"tests": PROGRAM_TESTS}), argparse.Namespace(max_turns=None, sandbox_allow_unisolated=True)
    )
    _, done, info = asyncio.run(env.step(f"```python\n{right}```<submit>"))
    assert done and info["reward"] == 1.0
    with pytest.raises(ValueError, match="a list of"):
        build_env(Sample(metadata={"tests": [{"input": "1"}]}))


def test_right_solutions_pass_whatever_they_print_or_define(mode):
    """What a real solution does: print a lot, use a namedtuple, a class, its own main block."""
    code = """import collections, sys
Pair = collections.namedtuple("Pair", "a b")
class Solution:
    def add(self, a, b):
        return Pair(a, b).a + b
def add(a, b):
    return Solution().add(a, b)
print("x" * 10000)
if __name__ == "__main__":
    print(add(int(input()), 1))
    sys.exit(3)
"""
    result, passed = asyncio.run(grade(code, HIDDEN, LIMITS))
    assert passed == 1.0 and result.truncated, result
    result, passed = asyncio.run(grade(WRONG, HIDDEN, LIMITS))
    assert passed == 0.0 and "hidden test 1 of 7 failed: AssertionError" in result.stderr


@needs_isolation
def test_a_sandbox_that_cannot_start_the_interpreter_fails_the_sample_not_scores_it(monkeypatch):
    """No interpreter inside the sandbox: an environment error naming why (the sample is FAILED by
    the rollout, as for any environment exception), never a run with exit code 127 graded 0."""
    monkeypatch.setattr(sandbox, "sandbox_mode", lambda: "isolated")
    monkeypatch.setattr(sandbox, "interpreter_paths", lambda: [])
    with pytest.raises(sandbox.SandboxError, match="could not run .*No such file"):
        run("print(1)")
    env = build_env(Sample(metadata={"tests": "assert add(2, 3) == 5"}))
    with pytest.raises(sandbox.SandboxError, match="could not run"):
        asyncio.run(env.step("```python\ndef add(a, b):\n    return a + b\n```<submit>"))


def test_without_isolation_model_code_is_refused_unless_allowed(monkeypatch):
    """Issue 44 item 3: no namespaces -> a SandboxError naming the opt-in flag (the sample FAILS);
    with --sandbox-allow-unisolated the run goes on and says it was not isolated, as a metric too."""
    monkeypatch.setattr(sandbox, "sandbox_mode", lambda: "limits-only")
    with pytest.raises(sandbox.SandboxError, match="--sandbox-allow-unisolated"):
        run("print(1)", SandboxLimits())
    tests = {"tests": "assert add(2, 3) == 5"}
    with pytest.raises(sandbox.SandboxError, match="--sandbox-allow-unisolated"):
        asyncio.run(build_env(Sample(metadata=tests)).step("```python\nprint(1)\n```"))
    env = build_env(Sample(metadata=tests), argparse.Namespace(max_turns=None, sandbox_allow_unisolated=True))
    observation, done, info = asyncio.run(env.step("```python\nprint(1)\n```"))
    assert observation == {"text": "1"} and not done and info["isolated"] == 0.0
    _, done, info = asyncio.run(env.step("```python\ndef add(a, b):\n    return a + b\n```<submit>"))
    assert done and info["reward"] == 1.0 and info["isolated"] == 0.0


@needs_isolation
def test_an_isolated_run_says_so():
    env = build_env(Sample(metadata={"tests": "assert add(2, 3) == 5"}))
    assert asyncio.run(env.step("```python\nprint(1)\n```"))[2]["isolated"] == 1.0
