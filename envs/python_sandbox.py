"""An environment for code: the model writes Python, the sandbox runs it, hidden tests grade it.

``PythonSandboxEnv``: the model writes code in a fenced ```python block; each turn the code runs in the
sandbox (``envs/sandbox.py``) and its output is the observation; a turn with ``<submit>``, or the last
valid turn of ``--max-turns``, is graded by the row's hidden tests (``metadata["tests"]``) and ends the
episode with reward 1 / 0. A sandbox that cannot run the code raises ``SandboxError`` (the sample is
FAILED, not scored 0).

Grading happens where the model's code cannot reach it (``grade``). The tests, what they expect and the
verdict never enter the process that runs the model's code: no file, argument, environment or memory of
it holds them, and no secret stands in for the verdict.

  function tests   ``metadata["tests"]`` is Python text (asserts, or HumanEval's ``check(candidate)``):
                   the model's code runs in its sandbox as a callee (``_callee.py``) that answers calls
                   with plain data (``_plain_data.py``: numbers, strings, bytes, and lists, tuples, sets,
                   dicts of them; never an object, never a callable); the tests run in a sandbox of their
                   own (``_test_runner.py``, non-dumpable), where each name of the solution is a proxy
                   whose calls this process relays, one JSON line each way. The asserts are decided
                   there, on plain data; the verdict is that process's exit status.
  program tests    ``metadata["tests"]`` is a list of ``{"input": text, "output": text}``: the program runs
                   in the sandbox on each input, and this process compares its output with the expected
                   one (lines with trailing white space removed, trailing empty lines dropped).

So an exit, a closed stream, a printed marker, a patched builtin or module, an object equal to everything,
a signal or a thread of the model's code changes only what its own process answers; its imports are its
own (numpy, logging, asyncio, ... are as welcome as anything the sandbox's interpreter has).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from envs.base import BaseInteractionEnv
from envs.sandbox import (
    MAX_CODE_BYTES,
    Sandboxed,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    run_python,
    sandbox_mode,
)
from slime_mt.errors import InvalidActionError

__all__ = [
    "PythonSandboxEnv",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "build_env",
    "code_block",
    "grade",
    "run_python",
    "sandbox_mode",
]

HERE = Path(__file__).parent
CALLEE, RUNNER, PLAIN_DATA = HERE / "_callee.py", HERE / "_test_runner.py", HERE / "_plain_data.py"
DEFAULT_LIMITS = SandboxLimits()


async def grade(
    code: str, tests: str | list[dict], limits: SandboxLimits = DEFAULT_LIMITS
) -> tuple[SandboxResult, float]:
    """``code`` graded by ``tests`` (Python text: function tests; a list of input/output cases: program
    tests) -> what the model sees of the grading, and 1.0 when every test passed, else 0.0."""
    if len(code.encode()) > MAX_CODE_BYTES:
        return SandboxResult("", f"[refused: the code is over {MAX_CODE_BYTES} bytes]", 1, False, False), 0.0
    if isinstance(tests, str):
        return await grade_functions(code, tests, limits)
    return await grade_program(code, tests, limits)


async def grade_functions(code: str, tests: str, limits: SandboxLimits) -> tuple[SandboxResult, float]:
    """Function tests: the solution answers in its sandbox, the tests ask and judge in theirs; this
    process relays the calls and takes the verdict from the tests' exit status."""
    plain = PLAIN_DATA.read_text()
    callee = await Sandboxed.start(
        CALLEE.read_text(), limits, files={"solution.py": code, PLAIN_DATA.name: plain}, channel=True
    )
    try:
        runner = await Sandboxed.start(RUNNER.read_text(), limits, files={PLAIN_DATA.name: plain}, channel=True)
    except BaseException:
        callee.kill()
        await callee.finish()
        raise
    ready = None
    try:
        ready = await callee.receive()
        names = (ready or {}).get("ready")
        if isinstance(names, list) and all(isinstance(name, str) for name in names):
            await runner.send({"tests": tests, "names": names})  # the tests go to the runner, nowhere else
            while (request := await runner.receive()) is not None:  # until the runner ends
                answer = await callee.receive() if await callee.send(request) else None
                if answer is None:  # the solution ended or went silent: the runner reads the end of its input
                    break
                if not await runner.send(answer):
                    break
        else:
            runner.kill()  # the solution did not load: no test runs
    finally:
        callee.kill()
        solution = await callee.finish()
        verdict = await _verdict(runner, ready is not None)
    failure = verdict.stderr.strip() if verdict.exit_code != 0 else ""
    if not failure and verdict.exit_code != 0:
        failure = "the solution did not load" if not solution.timed_out else "the hidden tests did not finish"
    result = SandboxResult(
        solution.stdout,
        "\n".join(part for part in (solution.stderr.strip(), failure) if part),
        verdict.exit_code,
        verdict.timed_out,
        solution.truncated,
        isolated=solution.isolated and verdict.isolated,
        escaped=solution.escaped,
    )
    return result, float(verdict.exit_code == 0 and not verdict.timed_out)


async def _verdict(runner: Sandboxed, sandbox_ran: bool) -> SandboxResult:
    """How the tests' process ended. Once the solution's sandbox has run (so the sandbox works), a tests'
    process that reports nothing was killed from outside (without namespaces the solution can): no
    verdict, so no pass, and not an environment failure that would take the sample out of training."""
    try:
        return await runner.finish()
    except SandboxError:
        if not sandbox_ran:
            raise
        return SandboxResult("", "the hidden tests were stopped before their verdict", None, False, False)


def _lines(text: str) -> list[str]:
    """Output as compared: each line without trailing white space, trailing empty lines dropped."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


async def grade_program(code: str, cases: list[dict], limits: SandboxLimits) -> tuple[SandboxResult, float]:
    """Program tests: the program runs on each case's input; its output is compared here with the case's."""
    result = SandboxResult("", "", 0, False, False)
    for number, case in enumerate(cases, 1):
        expected = str(case["output"])
        room = dataclasses.replace(limits, output_bytes=max(limits.output_bytes, 2 * len(expected.encode()) + 1024))
        result = await run_python(code, room, stdin=str(case["input"]))
        why = None
        if result.timed_out or result.exit_code != 0:
            why = "the program did not end cleanly"
        elif result.truncated or _lines(result.stdout) != _lines(expected):
            why = "wrong output"
        if why is not None:
            failure = f"hidden test {number} of {len(cases)} failed: {why}"
            return dataclasses.replace(result, stderr="\n".join(p for p in (result.stderr.strip(), failure) if p)), 0.0
    return result, 1.0


_CODE = "```python"


def code_block(text: str) -> str | None:
    """The last fenced ```python block of ``text``, or None."""
    start = text.rfind(_CODE)
    if start < 0:
        return None
    end = text.find("```", start + len(_CODE))
    return text[start + len(_CODE) : end if end >= 0 else None].strip("\n")


class PythonSandboxEnv(BaseInteractionEnv):
    """Each turn: the model's last ```python block runs in the sandbox and its output is the
    observation. A turn with ``<submit>`` (or the last turn) is graded by the row's hidden tests
    (``grade``) -> reward 1, else 0 (``info["passed"]``)."""

    observation_role = "tool"

    def __init__(
        self, tests: str | list[dict], limits: SandboxLimits = DEFAULT_LIMITS, max_turns: int | None = None
    ) -> None:
        self.tests, self.limits, self.max_turns = tests, limits, max_turns
        self.runs = 0

    async def step(self, response_text: str) -> tuple[dict, bool, dict]:
        code = code_block(response_text)
        if code is None:
            raise InvalidActionError("Write your code in a ```python block (add <submit> when it is final).")
        last = self.max_turns is not None and self.runs + 1 >= self.max_turns  # the episode's last valid turn
        if "<submit>" in response_text or last:
            result, passed = await grade(code, self.tests, self.limits)
            info = {"reward": passed, "passed": passed, "runs": self.runs, "isolated": float(result.isolated)}
            return {"text": result.describe()}, True, info
        self.runs += 1
        result = await run_python(code, self.limits)
        info = {
            "timed_out": float(result.timed_out),
            "exit_code": result.exit_code if result.exit_code else 0,
            "isolated": float(result.isolated),  # the run's isolation, a metric (env/isolated)
        }
        return {"text": result.describe() or "[no output]"}, False, info


def tests_of(metadata: dict) -> str | list[dict]:
    """A row's hidden tests: Python text, or a non-empty list of {"input", "output"} cases (ValueError
    naming what is wrong otherwise)."""
    tests = metadata.get("tests")
    if isinstance(tests, str):
        return tests
    if isinstance(tests, list) and tests and all(isinstance(c, dict) and {"input", "output"} <= set(c) for c in tests):
        return tests
    raise ValueError(
        "envs.python_sandbox: the row needs metadata['tests']: Python asserts, as text, or a list of "
        '{"input": ..., "output": ...} cases'
    )


def build_env(sample=None, args=None, **kw) -> PythonSandboxEnv:
    metadata = (sample.metadata if sample is not None else None) or {}
    max_turns = getattr(args, "max_turns", None)
    limits = SandboxLimits(allow_unisolated=bool(getattr(args, "sandbox_allow_unisolated", False)))
    return PythonSandboxEnv(tests_of(metadata), limits, max_turns=int(max_turns) if max_turns else None)
