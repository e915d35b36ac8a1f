"""Sandboxed Python: model-written code in a separate process, limited and isolated, never blocking
the rollout's event loop.

``await run_python(code, limits)`` -> ``SandboxResult``; ``await Sandboxed.start(...)``: code to talk to
while it runs (JSON lines on its stdin, and from its channel, fd 3). What is enforced:

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
  no privilege                                   every capability dropped, none regained, no_new_privs
                                                 (under isolation in a user namespace of its own)

Isolation uses ``unshare`` (util-linux) to make user, mount, network and PID namespaces; where the
kernel refuses unprivileged user namespaces the run still has the resource limits, the wall time,
the fresh folder and the cleared environment, and ``sandbox_mode()`` says that network and file
isolation are missing (logged once as a warning). Such a run (``--sandbox-allow-unisolated`` only)
executes as this process's user: this process first makes itself non-dumpable, so the code cannot
read its memory or descriptors, and the code has no capability (root's included) to get past that;
files that user can read, other processes of the user and the network stay reachable.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

logger = logging.getLogger(__name__)

INIT = Path(__file__).with_name("_sandbox_init.py")
MAX_CODE_BYTES = 64 * 1024
MESSAGE_BYTES = 1 << 20  # a line of a sandbox's channel at most
KILL_GRACE_SECONDS = 5.0
WORKDIR = "/sandbox"  # the code's working folder under isolation (the tmpfs root's only writable place)
SYSTEM_READ_ONLY = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache"]
PR_SET_DUMPABLE = 4


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
    exit_code: int | None  # None: killed (at the wall time, or by its host)
    timed_out: bool
    truncated: bool  # stdout or stderr was cut at output_bytes
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


class Sandboxed:
    """Code running in the sandbox (``start``), talked to while it runs: a message to its stdin
    (``send``, one JSON line), the next message of its channel at fd 3 (``receive``), and ``finish``: its
    stdin closed, the code waited for until the wall time (then killed with everything it started), the
    run's folder removed -> how it ended. Its stdout and stderr are read as they come, the first
    ``output_bytes`` kept."""

    def __init__(self, process, root: str, status_read: int, channel, isolated: bool, limits: SandboxLimits):
        self.process, self.root, self.status_read = process, root, status_read
        self.channel, self.isolated, self.limits = channel, isolated, limits  # (reader, transport) or None
        self.deadline = asyncio.get_running_loop().time() + limits.wall_seconds
        self.killed = False  # by its host (``kill``): not the sandbox's failure when nothing is reported
        self.out, self.err = _Capped(limits.output_bytes), _Capped(limits.output_bytes)
        self.reading = asyncio.ensure_future(
            asyncio.gather(self.out.read(process.stdout), self.err.read(process.stderr))
        )

    @classmethod
    async def start(
        cls,
        code: str,
        limits: SandboxLimits = SandboxLimits(),
        files: dict[str, str] | None = None,
        channel: bool = False,
    ) -> Sandboxed:
        """``code`` (as main.py, ``files`` beside it by name) started in a sandbox; with ``channel``, fd 3
        of the code is a pipe to ``receive``."""
        for name in files or {}:
            if "/" in name or name in ("", ".", "..", "main.py"):
                raise ValueError(f"sandbox file name {name!r}: a plain name other than main.py")
        isolate = sandbox_mode() == "isolated"
        if not isolate:
            _not_dumpable()
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
        read_only, rlimits = await asyncio.to_thread(
            lambda: ([*SYSTEM_READ_ONLY, *interpreter_paths()], _rlimits(limits))
        )
        if isolate and any(p == WORKDIR or p.startswith(WORKDIR + "/") for p in read_only):
            raise RuntimeError(f"python sandbox: the interpreter lives under {WORKDIR}, the sandbox's working folder")
        root = tempfile.mkdtemp(prefix="slime-mt-sandbox-")
        status_read, status_write = os.pipe()
        channel_read, channel_write = os.pipe() if channel else (None, None)
        config = {
            "isolate": isolate,
            "root": root,
            "code": code,
            "files": dict(files or {}),
            "python": sys.executable,
            "read_only": read_only,
            "workdir": WORKDIR,
            "status_fd": status_write,
            "channel_fd": channel_write,
            "workdir_bytes": limits.workdir_mb * 2**20,
            "pid_max": max(limits.processes, 301) if isolate else 0,
            "rlimits": rlimits,
        }
        command = [sys.executable, "-I", "-S", str(INIT), json.dumps(config)]
        if isolate:
            command = [shutil.which("unshare"), *_UNSHARE_FLAGS, *command]
        kept = (status_write,) if channel_write is None else (status_write, channel_write)
        try:
            process = await _spawn(
                command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                start_new_session=True,  # its own process group: the wall-time kill takes all of it
                pass_fds=kept,
            )
        finally:
            for fd in kept:
                os.close(fd)
        reader = None
        if channel_read is not None:
            reader = asyncio.StreamReader(limit=MESSAGE_BYTES)
            transport, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(channel_read, "rb", 0)
            )
            reader = (reader, transport)
        return cls(process, root, status_read, reader, isolate, limits)

    def remaining(self) -> float:
        """Seconds left until the wall time."""
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    async def send(self, message: dict) -> bool:
        """One JSON line to the code's stdin -> False where it no longer reads it (ended, or by the wall time)."""
        try:
            self.process.stdin.write(json.dumps(message, allow_nan=False).encode() + b"\n")
            await asyncio.wait_for(self.process.stdin.drain(), self.remaining())
            return True
        except (BrokenPipeError, ConnectionResetError, asyncio.TimeoutError):
            return False

    async def receive(self) -> dict | None:
        """The next message of the code's channel -> None where it ends without one by the wall time, or
        sends a line over ``MESSAGE_BYTES`` or that is not a JSON object."""
        try:
            line = await asyncio.wait_for(self.channel[0].readline(), self.remaining())
            message = json.loads(line) if line else None
        except (asyncio.TimeoutError, ValueError, asyncio.LimitOverrunError, RecursionError):
            return None
        return message if isinstance(message, dict) else None

    def kill(self) -> None:
        """End the code now, with everything it started (``finish`` still collects how it ended)."""
        self.killed = True
        _kill(self.process)

    async def finish(self, stdin: str = "") -> SandboxResult:
        """``stdin`` fed to the code and closed; the code waited for until the wall time, then killed ->
        its output and how it ended. SandboxError where the sandbox itself could not run it."""
        timed_out = escaped = False
        process = self.process
        try:
            feeding = asyncio.ensure_future(_feed(process, stdin))
            done, _ = await asyncio.wait({self.reading}, timeout=self.remaining())
            if not done:
                timed_out = True
                _kill(process)
            # a killed run's pipes close with its processes; one that escaped the group (a daemon in its own
            # session, possible without namespaces) cannot hold us: its output so far is kept
            done, _ = await asyncio.wait({self.reading}, timeout=KILL_GRACE_SECONDS)
            if not done:
                escaped = True
                self.reading.cancel()
                await _kill_escaped(self.root, KILL_GRACE_SECONDS)
            feeding.cancel()
            await asyncio.wait_for(process.wait(), KILL_GRACE_SECONDS)
        except BaseException:
            _kill(process)
            raise
        finally:
            status = _read_status(self.status_read)
            if self.channel is not None:
                self.channel[1].close()
            await asyncio.to_thread(shutil.rmtree, self.root, True)
        if isinstance(status, str) or (status is None and not (timed_out or self.killed)):  # the sandbox failed
            why = status if isinstance(status, str) else self.err.text().strip()[-1000:] or "no reason given"
            mode = "isolated" if self.isolated else "limits-only"
            raise SandboxError(f"python sandbox ({mode}): could not run {sys.executable}: {why}")
        return SandboxResult(
            self.out.text(),
            self.err.text(),
            None if timed_out or status is None else os.waitstatus_to_exitcode(status),
            timed_out,
            self.out.dropped or self.err.dropped,
            isolated=self.isolated,
            escaped=escaped,
        )


async def run_python(
    code: str, limits: SandboxLimits = SandboxLimits(), files: dict[str, str] | None = None, stdin: str = ""
) -> SandboxResult:
    """Run ``code`` (and ``files`` beside it, by name) in a sandbox with ``stdin`` -> its output and how
    it ended."""
    if len(code.encode()) > MAX_CODE_BYTES:
        return SandboxResult("", f"[refused: the code is over {MAX_CODE_BYTES} bytes]", 1, False, False)
    sandboxed = await Sandboxed.start(code, limits, files)
    return await sandboxed.finish(stdin)


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


@functools.cache
def _not_dumpable() -> None:
    """Without namespaces the model's code runs as this process's user: this process makes itself
    non-dumpable first (once), so that code cannot read its memory or descriptors or attach to it (the
    rows it holds, what a grading compares); the code runs with no capability to override that."""
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
