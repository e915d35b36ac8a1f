"""Sandboxed Python: model-written code in a separate process, limited and isolated, never blocking
the rollout's event loop; and an environment that grades code by hidden tests.

``await run_python(code, limits)`` -> ``SandboxResult``. What is enforced:

  CPU time, memory (address space), file size,   always: resource limits set before the code runs
  open files, no core files                      (RLIMIT_CPU, AS, FSIZE, NOFILE, CORE)
  wall time                                      always: the run is killed at ``wall_seconds`` (with
                                                 its whole process tree where namespaces are used)
  an empty temporary working directory,          always: a fresh folder, removed after the run; under
  a cleared environment, output truncated        isolation a tmpfs of ``workdir_mb`` (a 1 GB write
                                                 fails there); only PATH, HOME and LANG are set
  no network                                     isolation: an empty network namespace (no interface
                                                 but a loopback that is down)
  nothing of the host's files but the            isolation: a mount namespace whose root is the tmpfs,
  interpreter and system libraries               with only the interpreter's and the system's library
                                                 folders bound read-only (pivot_root; old root detached)
  CPU share                                      always: nice 19 and SCHED_IDLE, which the code cannot
                                                 undo (RLIMIT_NICE 0): it runs on cores nothing else wants
  processes                                      RLIMIT_NPROC (enforced for a user other than root);
                                                 under isolation also the PID namespace's ``pid_max``
                                                 (kernels 6.14+; at least 301 by the kernel's floor)
  no privilege                                   isolation: a user namespace, every capability
                                                 dropped, no_new_privs

Isolation uses ``unshare`` (util-linux) to make user, mount, network and PID namespaces; where the
kernel refuses unprivileged user namespaces the run still has the resource limits, the wall time,
the fresh folder and the cleared environment, and ``sandbox_mode()`` says that network and file
isolation are missing (logged once as a warning).

``PythonSandboxEnv``: the model writes code in a fenced ```python block; each turn the code runs and
its output is the observation; a turn with ``<submit>``, or the last valid turn of ``--max-turns``,
is graded: ``grade()`` runs its code under ``_grade_harness.py``, then the row's hidden tests
(``metadata["tests"]``: Python asserts on plain data), and ends the episode with reward 1 / 0. The
grade is a per-run random token only the harness can report, after the last test passed; never the
exit code or the output, which the code controls (see ``_grade_harness.py`` for what it refuses).
A sandbox that cannot run the code raises ``SandboxError`` (the sample is FAILED, not scored 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

from envs.base import BaseInteractionEnv
from slime_mt.errors import InvalidActionError

logger = logging.getLogger(__name__)

INIT = Path(__file__).with_name("_sandbox_init.py")
HARNESS = Path(__file__).with_name("_grade_harness.py")
MAX_CODE_BYTES = 64 * 1024
REPORT_BYTES = 4096
KILL_GRACE_SECONDS = 5.0
WORKDIR = "/sandbox"  # the code's working folder under isolation (the tmpfs root's only writable place)
SYSTEM_READ_ONLY = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache"]


class SandboxError(RuntimeError):
    """The sandbox could not run the code (no interpreter inside it, no isolation where it is required):
    the environment's failure, so the sample is FAILED with this reason, never scored 0."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_mb: int = 512
    processes: int = 32
    file_mb: int = 16
    workdir_mb: int = 64
    output_bytes: int = 4096
    open_files: int = 64
    # where the kernel refuses unprivileged user namespaces, run anyway with the limits alone
    # (--sandbox-allow-unisolated): host files, other processes' memory, the network, setuid programs
    # stay reachable and a daemon may outlive the run; by default such a run is a SandboxError
    allow_unisolated: bool = False


@dataclasses.dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None: killed at the wall time
    timed_out: bool
    truncated: bool  # stdout or stderr was cut at output_bytes
    report: bytes = b""  # what the code wrote to fd 3 (run_python(report=True)), up to REPORT_BYTES
    isolated: bool = True  # run in its own namespaces (False: limits only, --sandbox-allow-unisolated)
    escaped: bool = False  # a process of the code kept its output open past the run (limits only)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def describe(self) -> str:
        """What the model sees: the output, then why the run ended when it did not end well."""
        parts = [self.stdout]
        if self.stderr:
            parts.append(self.stderr)
        if self.truncated:
            parts.append("[output truncated]")
        if self.escaped:
            parts.append("[a process the code started kept running after it; its output was not waited for]")
        if self.timed_out:
            parts.append("[killed: the wall-time limit was reached]")
        elif self.exit_code not in (0, None):
            if self.exit_code < 0:
                name = signal.Signals(-self.exit_code).name
                why = {"SIGXCPU": "the CPU-time limit was reached", "SIGKILL": "killed"}.get(name, name)
                parts.append(f"[terminated by {name}: {why}]")
            else:
                parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(p for p in parts if p).strip()


_UNSHARE_FLAGS = ["--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child"]


@functools.lru_cache(maxsize=1)
def sandbox_mode() -> str:
    """``isolated`` when unshare can make user, mount, network and PID namespaces here, else
    ``limits-only`` (resource limits, wall time, fresh folder, cleared environment)."""
    unshare = shutil.which("unshare")
    if unshare is not None:
        command = [unshare, *_UNSHARE_FLAGS, "true"]
        if subprocess.run(command, capture_output=True, timeout=30).returncode == 0:
            return "isolated"
    logger.warning(
        "python sandbox: no unprivileged user namespaces here (unshare %s), so code runs with resource "
        "limits, a wall time, a fresh folder and a cleared environment, but WITHOUT network or file "
        "isolation",
        "missing" if unshare is None else "refused",
    )
    return "limits-only"


def _rlimits(limits: SandboxLimits) -> dict[str, int]:
    return {
        "RLIMIT_CPU": limits.cpu_seconds,
        "RLIMIT_AS": limits.memory_mb * 2**20,
        "RLIMIT_FSIZE": limits.file_mb * 2**20,
        "RLIMIT_NOFILE": limits.open_files,
        "RLIMIT_CORE": 0,
        # counted per user, all of the user's processes: room for ``processes`` more (root is exempt)
        "RLIMIT_NPROC": limits.processes + _own_processes() if os.getuid() != 0 else limits.processes,
    }


def _own_processes() -> int:
    """How many processes this user runs now (RLIMIT_NPROC counts them all, not the sandbox's alone)."""
    uid = str(os.getuid())
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as fh:
                    count += any(line.startswith("Uid:") and line.split()[1] == uid for line in fh)
            except OSError:
                continue
    return count


class _Capped:
    """One output stream of a run: its first ``limit`` bytes (the rest is read and dropped, so the
    writer never blocks on a full pipe), kept as they come so a read given up on still has them."""

    def __init__(self, limit: int):
        self.limit, self.kept, self.dropped = limit, bytearray(), False

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            room = self.limit - len(self.kept)
            self.kept += chunk[: max(room, 0)]
            self.dropped = self.dropped or len(chunk) > room

    def text(self) -> str:
        return self.kept.decode(errors="replace")


async def run_python(
    code: str,
    limits: SandboxLimits = SandboxLimits(),
    files: dict[str, str] | None = None,
    stdin: str = "",
    report: bool = False,
) -> SandboxResult:
    """Run ``code`` (and ``files`` beside it, by name) in a sandbox -> its output and how it ended;
    with ``report``, the code also has a report channel at fd 3 (``SandboxResult.report``)."""
    if len(code.encode()) > MAX_CODE_BYTES:
        return SandboxResult("", f"[refused: the code is over {MAX_CODE_BYTES} bytes]", 1, False, False)
    for name in files or {}:
        if "/" in name or name in ("", ".", "..", "main.py"):
            raise ValueError(f"sandbox file name {name!r}: a plain name other than main.py")
    isolate = sandbox_mode() == "isolated"
    if not isolate and not limits.allow_unisolated:
        raise SandboxError(
            "python sandbox: this machine refuses unprivileged user namespaces (unshare), so model code would "
            "run without isolation: host files, other processes' memory, the network and setuid programs "
            "reachable, daemons surviving the run. Enable user namespaces (e.g. sysctl "
            "kernel.unprivileged_userns_clone=1, or kernel.apparmor_restrict_unprivileged_userns=0), or pass "
            "--sandbox-allow-unisolated to run it with resource limits, a wall time, a fresh folder and a "
            "cleared environment only"
        )
    # off the event loop: the paths and the limits (RLIMIT_NPROC counts this user's processes in /proc,
    # thousands on a busy node); many runs started at once then spawn in turns, the loop ticking between
    read_only, rlimits = await asyncio.to_thread(lambda: ([*SYSTEM_READ_ONLY, *interpreter_paths()], _rlimits(limits)))
    if isolate and any(p == WORKDIR or p.startswith(WORKDIR + "/") for p in read_only):
        raise RuntimeError(f"python sandbox: the interpreter lives under {WORKDIR}, the sandbox's working folder")
    root = tempfile.mkdtemp(prefix="slime-mt-sandbox-")
    status_read, status_write = os.pipe()
    report_read, report_write = os.pipe() if report else (None, None)
    config = {
        "isolate": isolate,
        "root": root,
        "code": code,
        "files": dict(files or {}),
        "python": sys.executable,
        "read_only": read_only,
        "workdir": WORKDIR,
        "status_fd": status_write,
        "report_fd": report_write,
        "workdir_bytes": limits.workdir_mb * 2**20,
        "pid_max": max(limits.processes, 301) if isolate else 0,
        "rlimits": rlimits,
    }
    command = [sys.executable, "-I", "-S", str(INIT), json.dumps(config)]
    if isolate:
        command = [shutil.which("unshare"), *_UNSHARE_FLAGS, *command]
    process = await _spawn(
        command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        start_new_session=True,  # its own process group: the wall-time kill takes all of it
        pass_fds=(status_write,) if report_write is None else (status_write, report_write),
    )
    os.close(status_write)
    if report_write is not None:
        os.close(report_write)
    timed_out = escaped = False
    out, err = _Capped(limits.output_bytes), _Capped(limits.output_bytes)
    try:
        reading = asyncio.ensure_future(asyncio.gather(out.read(process.stdout), err.read(process.stderr)))
        feeding = asyncio.ensure_future(_feed(process, stdin))
        done, _ = await asyncio.wait({reading}, timeout=limits.wall_seconds)
        if not done:
            timed_out = True
            _kill(process)
        # a killed run's pipes close with its processes; one that escaped the group (a daemon in its own
        # session, possible without namespaces) cannot hold us: its output so far is kept
        done, _ = await asyncio.wait({reading}, timeout=KILL_GRACE_SECONDS)
        if not done:
            escaped = True
            reading.cancel()
            await _kill_escaped(root, KILL_GRACE_SECONDS)
        feeding.cancel()
        await asyncio.wait_for(process.wait(), KILL_GRACE_SECONDS)
    except BaseException:
        _kill(process)
        raise
    finally:
        status = _read_status(status_read)
        reported = _read_pipe(report_read, REPORT_BYTES) if report_read is not None else b""
        await asyncio.to_thread(shutil.rmtree, root, True)
    if isinstance(status, str) or (status is None and not timed_out):  # the sandbox failed, not the code
        why = status if isinstance(status, str) else err.text().strip()[-1000:] or "no reason given"
        raise SandboxError(
            f"python sandbox ({'isolated' if isolate else 'limits-only'}): could not run {sys.executable}: {why}"
        )
    return SandboxResult(
        out.text(),
        err.text(),
        None if timed_out else os.waitstatus_to_exitcode(status),
        timed_out,
        out.dropped or err.dropped,
        reported,
        isolated=isolate,
        escaped=escaped,
    )


_SPAWNING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


async def _spawn(command: list[str], **kwargs) -> asyncio.subprocess.Process:
    """Start ``command``, one spawn at a time per event loop: a spawn holds the loop (fork, exec, the
    child watcher), tens of milliseconds on a loaded machine, and a batch of tool calls starts many runs
    at once; in turns, the loop serves its other work between two."""
    lock = _SPAWNING.setdefault(asyncio.get_running_loop(), asyncio.Lock())
    async with lock:
        return await asyncio.create_subprocess_exec(*command, **kwargs)


def _read_status(fd: int) -> int | str | None:
    """The code's wait status the sandbox's init reported, or why the code could not start (str), or
    None when it reported nothing; closes ``fd``."""
    lines = _read_pipe(fd, 4096).decode(errors="replace").splitlines()
    failed = [line.removeprefix("start-failed ") for line in lines if line.startswith("start-failed ")]
    if failed:
        return failed[0]
    try:
        return int(lines[-1]) if lines else None
    except ValueError:
        return None


def interpreter_paths() -> list[str]:
    """The folders the interpreter needs, as named and as resolved: the environment's prefixes and
    every hop of the executable's symlinks (a venv or conda env reached through a link is common; a
    link bound without its target leaves nothing to run)."""
    paths = {sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    hop = sys.executable
    for _ in range(40):  # the kernel's own limit on a chain of links
        paths.add(os.path.dirname(hop))
        paths.add(os.path.realpath(os.path.dirname(hop)))
        if not os.path.islink(hop):
            break
        hop = os.path.join(os.path.dirname(hop), os.readlink(hop))
    return sorted(paths)


def _read_pipe(fd: int, limit: int) -> bytes:
    """What is in the pipe now (up to ``limit`` bytes; a writer still alive cannot hold us), closing ``fd``."""
    try:
        os.set_blocking(fd, False)
        return os.read(fd, limit)
    except BlockingIOError:
        return b""
    finally:
        os.close(fd)


async def _feed(process, stdin: str) -> None:
    try:
        if stdin:
            process.stdin.write(stdin.encode())
            await process.stdin.drain()
        process.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


async def _kill_escaped(root: str, seconds: float) -> None:
    """SIGKILL what is left of a run outside its process group (a daemon, possible without namespaces):
    the processes whose working folder is still the run's, again until none is left alive (a kill takes
    effect a moment later, and one may fork in between) or ``seconds`` have passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while _signal_alive_in(root) and loop.time() < deadline:
        await asyncio.sleep(0.01)


def _signal_alive_in(root: str) -> bool:
    """SIGKILL every live process whose working folder is under ``root`` -> whether there was one."""
    found = False
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if not os.readlink(f"/proc/{entry.name}/cwd").startswith(root):
                    continue
                with open(f"/proc/{entry.name}/stat", "rb") as fh:
                    state = fh.read().rsplit(b")", 1)[1].split()[0]
                if state in (b"Z", b"X"):  # dead, waiting to be reaped: nothing left to kill
                    continue
                os.kill(int(entry.name), signal.SIGKILL)
                found = True
            except (OSError, IndexError):
                continue
    return found


def _kill(process) -> None:
    """SIGKILL the run's process group (under isolation, the PID namespace's first process dies with
    it, and the kernel kills everything else in the namespace)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def grade(code: str, tests: str, limits: SandboxLimits = SandboxLimits()) -> tuple[SandboxResult, float]:
    """Run ``code`` then the hidden ``tests`` under the grading harness (``_grade_harness.py``) ->
    the run and 1.0 when every test passed, else 0.0. A pass is a per-run random token that only the
    harness can report, after the last test: an early exit, a closed stdout, a printed marker or a
    patched builtin of the code earns nothing."""
    if len(code.encode()) > MAX_CODE_BYTES:
        return SandboxResult("", f"[refused: the code is over {MAX_CODE_BYTES} bytes]", 1, False, False), 0.0
    token, grade_file = secrets.token_hex(16), f".grade-{secrets.token_hex(8)}"
    files = {"solution.py": code, grade_file: token}
    stdin = json.dumps({"tests": tests, "grade_file": grade_file})
    result = await run_python(HARNESS.read_text(), limits, files=files, stdin=stdin, report=True)
    return result, float(hmac.compare_digest(result.report, token.encode()))


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
    observation. A turn with ``<submit>`` (or the last turn) is graded: the code, then the row's
    hidden tests (asserts), must run cleanly -> reward 1, else 0 (``info["passed"]``)."""

    observation_role = "tool"

    def __init__(self, tests: str, limits: SandboxLimits = SandboxLimits(), max_turns: int | None = None) -> None:
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


def build_env(sample=None, args=None, **kw) -> PythonSandboxEnv:
    metadata = (sample.metadata if sample is not None else None) or {}
    if not isinstance(metadata.get("tests"), str):
        raise ValueError("envs.python_sandbox: the row needs metadata['tests'] (Python asserts, as text)")
    max_turns = getattr(args, "max_turns", None)
    limits = SandboxLimits(allow_unisolated=bool(getattr(args, "sandbox_allow_unisolated", False)))
    return PythonSandboxEnv(metadata["tests"], limits, max_turns=int(max_turns) if max_turns else None)
