"""The Python sandbox (envs/python_sandbox.py): each attack stopped or refused within its limit with a
clear message to the model, no process or file left behind, the event loop never stalled, and the
code environment graded by hidden tests."""

import argparse
import asyncio
import glob
import os
import socket
import sys
import tempfile
import time

import pytest

import envs.python_sandbox as sandbox
from envs.python_sandbox import PythonSandboxEnv, SandboxLimits, build_env, code_block, run_python, sandbox_mode
from slime_mt.errors import InvalidActionError
from slime_mt.types import Sample

# allow_unisolated: the limits-only mode is tested too (refused without it: see the isolation tests)
LIMITS = SandboxLimits(
    cpu_seconds=2, wall_seconds=5, memory_mb=256, file_mb=8, workdir_mb=32, output_bytes=2048, allow_unisolated=True
)
ISOLATED = sandbox_mode() == "isolated"
needs_isolation = pytest.mark.skipif(not ISOLATED, reason="no unprivileged user namespaces on this machine")


@pytest.fixture(params=["isolated", "limits-only"])
def mode(request, monkeypatch):
    """Each test in both modes: namespaces where this machine allows them, and the fallback."""
    if request.param == "isolated" and not ISOLATED:
        pytest.skip("no unprivileged user namespaces on this machine")
    monkeypatch.setattr(sandbox, "sandbox_mode", lambda: request.param)
    return request.param


def run(code: str, limits: SandboxLimits = LIMITS, **kw):
    started = time.perf_counter()
    result = asyncio.run(run_python(code, limits, **kw))
    return result, time.perf_counter() - started


def sandbox_processes() -> list[str]:
    """Processes still running that the sandbox started (its launcher, or code it ran)."""
    found = []
    for entry in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(entry, "rb") as fh:
                line = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "_sandbox_init.py" in line or "main.py" in line.split(" ")[-2:]:
            found.append(line)
    return found


def test_clean_code_runs_in_an_empty_folder_with_a_cleared_environment(mode):
    result, _ = run("import os\nprint(sorted(os.listdir('.')), sorted(os.environ))\nprint(input())", stdin="in\n")
    names = ["HOME", "LANG", "PATH", "PYTHONDONTWRITEBYTECODE"] + (["TMPDIR"] if mode == "limits-only" else [])
    assert result.ok and result.stdout == f"['main.py'] {names}\nin\n"
    result, _ = run("print(open('data.txt').read())", files={"data.txt": "given"})
    assert result.stdout == "given\n"


def test_an_infinite_loop_stops_at_the_cpu_limit(mode):
    # a wall limit far past the CPU limit: SIGXCPU, not the wall clock, must be what stops it (on a loaded
    # 2-core machine 2 CPU seconds took 4 s of wall time, so a wall-time bound near the CPU limit flaked)
    limits = SandboxLimits(cpu_seconds=2, wall_seconds=30, allow_unisolated=True)
    result, seconds = run("while True: pass", limits)
    assert result.exit_code == -24 and not result.timed_out and limits.cpu_seconds <= seconds < limits.wall_seconds
    assert "SIGXCPU: the CPU-time limit was reached" in result.describe()


def test_a_sleeper_stops_at_the_wall_time(mode):
    result, seconds = run("import time\ntime.sleep(60)", SandboxLimits(wall_seconds=1.5, allow_unisolated=True))
    assert result.timed_out and result.exit_code is None and 1.5 <= seconds < 4
    assert result.describe() == "[killed: the wall-time limit was reached]"


def test_a_memory_bomb_gets_a_memory_error(mode):
    result, _ = run("x = bytearray(2**30)")
    assert result.exit_code == 1 and "MemoryError" in result.stderr


def test_a_fork_bomb_is_refused_and_leaves_no_process(mode):
    # root without namespaces is exempt from RLIMIT_NPROC: only the wall time bounds the bomb there,
    # so it is kept small (300 forks) and the test checks that bound and the clean-up instead
    unbounded = mode == "limits-only" and os.getuid() == 0
    bomb = (
        f"import os, time\nn = 0\ntry:\n    while n < {300 if unbounded else 5000}:\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
        "    print('refused after', n, e.errno)\nelse:\n    print('forked', n)\n"
    )
    result, seconds = run(bomb)
    if unbounded:  # the sleepers hold the output open until the wall-time kill takes the process group
        assert result.timed_out and result.stdout == "forked 300\n"
    else:
        refused = int(result.stdout.split()[2])
        assert refused < 400 and result.stdout.endswith(" 11\n")  # EAGAIN: the namespace's pid_max, or RLIMIT_NPROC
    assert seconds < LIMITS.wall_seconds + 2
    assert sandbox_processes() == []  # the sleepers died with the namespace (or the process group)


def test_a_1_gb_write_fails_at_the_file_size_limit(mode):
    result, _ = run("f = open('big', 'wb')\nfor _ in range(1024):\n    f.write(b'x' * 2**20)")
    assert result.exit_code == 1 and "File too large" in result.stderr


@needs_isolation
def test_a_network_connection_is_refused():
    with socket.socket() as server:  # a real listener on the host's loopback
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result, _ = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert result.exit_code == 1 and "Network is unreachable" in result.stderr


@needs_isolation
def test_a_read_outside_the_working_folder_finds_nothing_of_the_host(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    for path in (str(secret), "/etc/passwd", __file__):
        result, _ = run(f"print(open({path!r}).read())")
        assert result.exit_code == 1 and "No such file or directory" in result.stderr, path
    result, _ = run("import os\nos.makedirs('/usr/evil')")  # the interpreter's folders are read-only
    assert result.exit_code == 1 and "Read-only file system" in result.stderr


def test_output_is_truncated(mode):
    result, _ = run("print('x' * 100000)")
    assert result.truncated and len(result.stdout) == LIMITS.output_bytes
    assert result.describe().endswith("[output truncated]")


def test_200_runs_in_a_row_leave_no_process_and_no_temporary_file():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "slime-mt-sandbox-*")))

    async def many():
        return [await run_python(f"print({k} * 2)", LIMITS) for k in range(200)]

    results = asyncio.run(many())
    assert [r.stdout for r in results] == [f"{k * 2}\n" for k in range(200)]
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "slime-mt-sandbox-*"))) == before
    assert sandbox_processes() == []


def test_16_concurrent_runs_do_not_stall_the_event_loop():
    async def scenario():
        ticks, gaps = [], []

        async def heartbeat():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                ticks.append(now)
                last = now

        beat = asyncio.create_task(heartbeat())
        results = await asyncio.gather(
            *(run_python("import time\ntime.sleep(0.5)\nprint('ok')", LIMITS) for _ in range(16))
        )
        beat.cancel()
        return results, gaps

    results, gaps = asyncio.run(scenario())
    assert all(r.stdout == "ok\n" for r in results)
    assert len(gaps) > 30 and max(gaps) < 0.5  # the loop kept ticking while 16 sandboxes ran


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


# ---------------------------------------------------------------- grading that the code cannot fake (issue 44, 1)

HIDDEN = """assert add(2, 3) == 5
assert add(-1, 1) == 0
import math
assert math.isclose(add(0.1, 0.2), 0.3)
assert abs(add(1, 1) - 2) < 1e-9
assert all(add(x, x) == 2 * x for x in range(3))
assert add(2, 2)
"""
WRONG = "def add(a, b):\n    return a - b\n"
GRADE_FILE = "[f for f in os.listdir('.') if f.startswith('.grade')][0]"
HACKS = {
    "os._exit(0)": "import os\nos._exit(0)",
    "sys.exit(0)": "import sys\nsys.exit(0)",
    "SystemExit(0) in an atexit hook": "import atexit, sys\natexit.register(lambda: sys.exit(0))\nraise SystemExit(0)",
    "a kill of itself with a clean status": (
        "import os, signal\nsignal.signal(signal.SIGTERM, lambda *a: os._exit(0))\nos.kill(os.getpid(), signal.SIGTERM)"
    ),
    "closing stdout and stderr": "import os\nos.close(1)\nos.close(2)",
    "printing a success marker and a forged report": (
        "import os\nprint('All tests passed. OK')\nos.write(3, b'0' * 32)\nos.write(3, open('main.py', 'rb').read())"
    ),
    "an object equal to everything": (
        "class Any:\n    __eq__ = lambda s, o: True\n    __lt__ = lambda s, o: True\n    __bool__ = lambda s: True\n"
        "    __sub__ = lambda s, o: s\n    __abs__ = lambda s: s\n"
        "def add(a, b):\n    return Any()"
    ),
    "an int subclass equal to everything": (
        "class Int(int):\n    __eq__ = lambda s, o: True\n    __lt__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
        "    __sub__ = lambda s, o: s\n    __abs__ = lambda s: s\n"
        "def add(a, b):\n    return Int(a - b)"
    ),
    "redefined builtins": (
        "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.all = lambda xs: True\ndef abs(x):\n    return 0\n"
        "class AssertionError(Exception):\n    pass\nbuiltins.AssertionError = AssertionError"
    ),
    "a monkeypatched module the tests use": "import math\nmath.isclose = lambda *a, **k: True",
    "a patched test runner": (
        "import builtins, __main__\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None\n"
        "__main__.plain = lambda v: v\n__main__.REFUSED_EVENTS = ()"
    ),
    "reading the token file": f"import os\nprint(open({GRADE_FILE}).read())",
    "reading the token file by a folder descriptor": (
        f"import os\nd = os.open('/', os.O_RDONLY)\nos.chdir('/tmp')\n"
        f"print(os.read(os.open(os.path.relpath(os.path.abspath({GRADE_FILE}), '/'), os.O_RDONLY, dir_fd=d), 99))"
    ),
    "a link to the token file": f"import os\nos.link({GRADE_FILE}, 'x')\nprint(open('x').read())",
    "reading its own memory": "print(open('/proc/self/mem', 'rb').read(1))",
    "the harness's frames": "import sys\nprint(sys._getframe(1).f_locals)",
    "frames through a traceback": (
        "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    print(e.__traceback__.tb_frame.f_back.f_locals)"
    ),
    "walking every object": "import gc\nprint([o for o in gc.get_objects() if isinstance(o, str) and len(o) == 32])",
    "ctypes": "import ctypes\nctypes.memmove",
    "a fresh interpreter": "import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import os; os._exit(0)'])",
    "an audit hook of its own": "import sys\nsys.addaudithook(lambda *a: None)",
    "a thread left running": (
        "import threading, time, os\n"
        f"def steal():\n    while True:\n        try:\n            os.write(3, open({GRADE_FILE}, 'rb').read())\n"
        "        except Exception:\n            time.sleep(0.001)\n"
        "threading.Thread(target=steal, daemon=True).start()"
    ),
}


@pytest.mark.parametrize("hack", HACKS)
def test_a_wrong_solution_with_a_reward_hack_earns_nothing(mode, hack):
    """Each hack after a wrong solution is graded 0."""
    result, passed = asyncio.run(sandbox.grade(WRONG + "\n" + HACKS[hack], HIDDEN, LIMITS))
    assert passed == 0.0, (hack, result)


@pytest.mark.parametrize(
    "hack", ["sys.exit(0)", "closing stdout and stderr", "an audit hook of its own", "os._exit(0)"]
)
def test_a_right_solution_with_the_same_tricks_is_graded_on_its_tests(mode, hack):
    """The grade follows the tests alone: a trick that leaves them to run (an exit the harness catches,
    closed output, a hook the harness silently refuses) leaves a right solution right; one that ends
    the process before them fails it."""
    right = "def add(a, b):\n    return a + b\n"
    _, passed = asyncio.run(sandbox.grade(right + HACKS[hack], HIDDEN, LIMITS))
    assert passed == (0.0 if hack == "os._exit(0)" else 1.0)


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
    result, passed = asyncio.run(sandbox.grade(code, HIDDEN, LIMITS))
    assert passed == 1.0 and result.truncated, result
    result, passed = asyncio.run(sandbox.grade(WRONG, HIDDEN, LIMITS))
    assert passed == 0.0 and "hidden test 1 of 7 failed: AssertionError" in result.stderr


def test_an_interpreter_reached_through_a_symlinked_env_runs(mode, tmp_path, monkeypatch):
    """Issue 44 item 2: a venv or conda env that is a link (the link and its target are bound)."""
    link = tmp_path / "env-link"
    link.symlink_to(sys.prefix, target_is_directory=True)
    monkeypatch.setattr(sys, "prefix", str(link))
    monkeypatch.setattr(sys, "executable", str(link / "bin" / os.path.basename(sys.executable)))
    result, _ = run("import sys\nprint(sys.version_info[0])")
    assert result.ok and result.stdout == "3\n", result
    _, passed = asyncio.run(sandbox.grade("def add(a, b):\n    return a + b\n", HIDDEN, LIMITS))
    assert passed == 1.0


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


# ---------------------------------------------------------------- isolation required, CPU share (issue 44, 3-4)


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


def test_a_daemon_holding_stdout_open_does_not_fail_the_caller(monkeypatch):
    """Without namespaces a daemon in its own session outlives the run's process group: the run ends at
    the wall time plus the grace with the output it had, marked, instead of a TimeoutError."""
    monkeypatch.setattr(sandbox, "sandbox_mode", lambda: "limits-only")
    monkeypatch.setattr(sandbox, "KILL_GRACE_SECONDS", 1.0)
    code = (
        "import os, time\nprint('before', flush=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(30)\n    os._exit(0)\n"
        "time.sleep(30)"
    )
    for wall in (2, 6, 18):  # sandboxed code runs SCHED_IDLE: on a busy machine it may get no CPU in 2 s
        result, took = run(code, SandboxLimits(wall_seconds=wall, allow_unisolated=True))
        if result.stdout:  # it ran, so it forked before the wall time
            break
    assert result.timed_out and result.escaped and result.stdout == "before\n", result
    assert "kept running" in result.describe() and took < wall + 8
    assert not sandbox_processes()  # the daemon, found by its working folder, was killed too


def test_sandboxed_code_runs_at_the_lowest_cpu_share_and_cannot_raise_it(mode):
    """Issue 44 item 4: nice 19 and SCHED_IDLE, inherited by every process the code starts, and no way
    back (RLIMIT_NICE 0), so spinning processes only take cores nothing else wants."""
    code = """import os
def state():
    return os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0) == os.SCHED_IDLE
child = os.fork()
if child == 0:
    print("child", *state(), flush=True)
    os._exit(0)
os.waitpid(child, 0)
print("code", *state())
back = lambda: os.setpriority(os.PRIO_PROCESS, 0, 0)
other = lambda: os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
for attempt in (back, other):
    try:
        attempt()
        print("raised")
    except PermissionError:
        print("refused")
print(*state())
"""
    result, _ = run(code)
    assert result.ok, result
    lines = result.stdout.split("\n")[:5]
    assert lines[:2] == ["child 19 True", "code 19 True"], lines
    if mode == "isolated" or os.getuid() != 0:  # root without namespaces keeps CAP_SYS_NICE
        assert lines[2:] == ["refused", "refused", "19 True"], lines
