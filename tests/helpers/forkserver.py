"""A pre-imported process for the suite's own ``slime-mt`` runs (issue 68, item 2).

Every ``python -m slime_mt.cli ...`` the tests start used to import torch, transformers and megatron-core
afresh: about 10 CPU-s a process on this machine, before the run did any work. ``install()`` (called
by tests/conftest.py in each pytest process) makes ``subprocess.Popen`` start such a command as a fork of
one server that imported them once (the approach of ``multiprocessing``'s forkserver with
``set_forkserver_preload``): the server forks a keeper per run, the keeper forks the run and reports its
pid, then its exit code and CPU seconds. What the caller holds is a ``subprocess.Popen`` as before:
``pid`` is the run's own (signals reach it), ``wait``, ``poll``, ``communicate`` and timeouts behave as
they do for a child, its stdin, stdout and stderr are the ones asked for (passed over the socket), its
working folder, environment, ``sys.path`` (``PYTHONPATH``) and ``sys.argv`` are the command's own, and
it exits as ``python -m`` does (``SystemExit``'s code, 1 on an uncaught exception, killed by SIGINT on
an uncaught ``KeyboardInterrupt``).

A command starts as a plain process instead when the fork could differ from it: not ``sys.executable
-m slime_mt.cli``, a ``preexec_fn``, ``pass_fds``, a user, group or umask, or an environment that differs
from the server's in a variable that a preloaded package may read at import (``IMPORT_TIME``: OMP,
CUDA, HF, torch and Python settings, the temp folder...). ``SLIME_MT_TEST_FORKSERVER=0`` turns it off.
Where the pytest process's own environment changed in such a variable (a test or a library set it for
good), its next run starts a second server with the environment as it is now.

The runs are not children of the pytest process, so their CPU time is added to ``tiers.FORKED_CPU``,
which the budget's CPU seconds count as the children's; the budget's summary says how many runs forked
and why the others did not (``tiers.FORKED``, ``tiers.PLAIN``)."""

from __future__ import annotations

import array
import atexit
import importlib
import io
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROUTED = {"slime_mt.cli"}  # the modules whose `python -m` runs fork from the server
# what a `slime-mt train` run imports that costs the most, in the order it does
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "safetensors.torch",
    "jinja2",
)
# environment variables a preloaded package may read at import: a run that sets one otherwise than the
# server starts as a plain process. (Not NVTE_*: transformer-engine is not preloaded, and megatron-core reads
# them when it builds a model, setting them in the process that does.)
IMPORT_TIME = (
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH_",
    "CUDA",
    "NCCL_",
    "NVIDIA_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "PYTHON",
    "LD_",
    "MEGATRON",
    "TMP",
    "TEMP",
    "HOME",
    "XDG_",
    "LANG",
    "LC_",
    "PATH",
)
# read when used, not at import: PYTHONPATH becomes the run's sys.path; ray.init() sets PYTHONBREAKPOINT in
# the process that calls it (a pytest worker, for the tests that drive a cluster themselves)
READ_LATER = {"PYTHONPATH", "PYTHONBREAKPOINT"}
READY = b"ready\n"


def serve(name: str) -> None:
    """Import ``PRELOAD``, listen on the abstract unix socket ``name`` and fork a keeper per request,
    until stdin closes (the pytest process that started it is gone)."""
    for module in PRELOAD:
        importlib.import_module(module)
    if threading.active_count() != 1:  # a fork would lose the other threads
        sys.exit(f"forkserver: {threading.active_count()} threads after the preload; not serving")
    base_path = [p for p in sys.path if p not in _pythonpath(os.environ)][1:]  # without this script's folder
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(_address(name))
    listener.listen(16)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 1.0)
        _reap()
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        request, fds = _receive(conn)
        if os.fork() == 0:
            listener.close()
            _keep(conn, request, fds, base_path)  # never returns
        conn.close()
        for fd in fds:
            os.close(fd)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    while not data.endswith(b"\n"):
        data += conn.recv(1 << 20)
    return json.loads(data), list(fds)


def _keep(conn: socket.socket, request: dict, fds: list[int], base_path: list[str]) -> None:
    """The keeper: fork the run, report its pid, wait for it, report its exit code and CPU seconds."""
    try:
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run(request, fds, base_path)  # never returns
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while True:  # until the run ends; the caller gone (its connection closed), the run is killed
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if select.select([conn], [], [], 0.2)[0] and not conn.recv(1):
                os.kill(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
                break
        cpu = usage.ru_utime + usage.ru_stime
        conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status), "cpu": cpu}).encode() + b"\n")
    finally:
        os._exit(0)


def _run(request: dict, fds: list[int], base_path: list[str]) -> None:
    """The run: the command's streams, folder, environment, path and arguments, then ``python -m``."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        if request["new_session"]:
            os.setsid()
        elif request["process_group"] is not None:
            os.setpgid(0, request["process_group"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = [os.getcwd(), *_pythonpath(os.environ), *base_path]
        tempfile.tempdir = None
        if "numpy" in sys.modules:  # a fresh process draws numpy's global state anew (random reseeds itself)
            sys.modules["numpy"].random.seed()
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        sys.stdout, sys.stderr = _stream(1, line_buffering=os.isatty(1)), _stream(2, line_buffering=True)
        sys.argv = ["-m", *request["args"]]
        code = 0
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            code = _exit_code(exit_.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            traceback.print_exc()
            code = 1
        _finish()
    except BaseException:  # the run could not be set up: said on its stderr
        os.write(2, traceback.format_exc().encode())
    finally:
        os._exit(code)


def _stream(fd: int, line_buffering: bool) -> io.TextIOWrapper:
    """stdout or stderr as Python opens them (unbuffered under PYTHONUNBUFFERED, the same in the server)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    binary = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
    errors = "backslashreplace" if fd == 2 else "strict"
    return io.TextIOWrapper(
        binary, encoding="utf-8", errors=errors, line_buffering=line_buffering, write_through=unbuffered
    )


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _finish() -> None:
    """What the interpreter does at exit: wait for the threads that are not daemons, run atexit, flush."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _address(name: str) -> str:
    """A socket in Linux's abstract namespace: a file's path is limited to 107 bytes, which a long temp
    folder (TMPDIR) passes, and then no server could start."""
    return "\0" + name


def _pythonpath(env) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


# ---------------------------------------------------------------- the pytest side


class Server:
    """A server of this pytest process, started with its environment as it is then."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="slime-mt-fork-"))
        self.name = self.folder.name  # of its socket (abstract: _address)
        self.env = dict(os.environ)
        log = open(self.folder / "server.log", "wb")
        self.process = PLAIN_POPEN(
            [sys.executable, __file__, self.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=self.env,
            start_new_session=True,
        )
        log.close()
        self.ok = self.process.stdout.readline() == READY
        if not self.ok:
            print(f"forkserver: not started, runs start as plain processes: {self.folder}/server.log", file=sys.stderr)

    def refuses(self, env) -> str | None:
        """Why a run with ``env`` (None: this process's) may not fork from this server; None if it may."""
        if not self.ok:
            log = (self.folder / "server.log").read_text(errors="replace").strip().splitlines()
            return f"the server did not start: {log[-1] if log else f'exit code {self.process.poll()}'}"
        run, own = _import_time(env), _import_time(self.env)
        changed = sorted(k for k in run.keys() | own.keys() if run.get(k) != own.get(k))
        return f"its environment sets {', '.join(changed)} otherwise than the server's" if changed else None

    def start(self, request: dict, fds: list[int]) -> tuple[int, Channel]:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(_address(self.name))
        data = json.dumps(request).encode() + b"\n"
        conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        channel = Channel(conn)
        return json.loads(channel.line(None))["pid"], channel

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)  # its log (closed once more at exit)


def _import_time(env) -> dict[str, str]:
    """The variables of ``env`` (None: this process's) that a preloaded package may read at import."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in READ_LATER}


class Channel:
    """The connection to a run's keeper, read a line at a time."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def line(self, timeout: float | None) -> bytes:
        """The next line; TimeoutError past ``timeout``, b'' when the keeper closes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.conn], [], [], wait)[0]:
                raise TimeoutError
            part = self.conn.recv(4096)
            if not part:
                return b""
            self.buffer += part
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line


PLAIN_POPEN = subprocess.Popen
SERVERS: list[Server] = []  # this process's, the first started at its first run
# a test or a library may change this process's own environment for good in a setting read at import: the
# next run then starts a server with the environment as it is, up to this many
MAX_SERVERS = 2


def _server() -> Server:
    """The server started with this process's environment as it is now (in what is read at import),
    started if there is none and fewer than ``MAX_SERVERS`` are; else the last one."""
    now = _import_time(None)
    for server in SERVERS:
        if _import_time(server.env) == now:
            return server
    if len(SERVERS) < MAX_SERVERS:
        SERVERS.append(Server())
        atexit.register(SERVERS[-1].close)
    return SERVERS[-1]


class Popen(subprocess.Popen):
    """``subprocess.Popen``; ``python -m slime_mt.cli ...`` forked from the server when it can be."""

    _channel: Channel | None = None  # set while a forked run has not reported its exit

    def _execute_child(
        self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals,
        gid, gids, uid, umask, start_new_session, process_group,
    ):  # fmt: skip
        routed = (
            isinstance(args, (list, tuple)) and len(args) > 2 and str(args[0]) == sys.executable
            and args[1] == "-m" and args[2] in ROUTED and executable in (None, sys.executable)
            and not (shell or preexec_fn or pass_fds) and (gid, gids, uid, umask) == (None, None, None, -1)
        )  # fmt: skip
        import tiers

        refused = routed and _server().refuses(env)
        if refused:
            tiers.PLAIN.append(refused)
        if not routed or refused:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals,
                gid, gids, uid, umask, start_new_session, process_group,
            )  # fmt: skip
        request = {
            "module": args[2],
            "args": [os.fspath(a) for a in args[3:]],
            "cwd": os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd()),
            "env": dict(os.environ if env is None else env),
            "new_session": bool(start_new_session),
            "process_group": process_group if process_group not in (None, -1) else None,
        }
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        try:
            self.pid, self._channel = _server().start(request, fds)
            self._child_created = True
            tiers.FORKED[0] += 1
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _status(self, timeout: float | None) -> None:
        """The run's exit code (and its CPU seconds, to the budget) once its keeper sends them."""
        import tiers

        try:
            line = self._channel.line(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        status = json.loads(line) if line else {"code": 255, "cpu": 0.0}  # the keeper is gone
        self._channel.conn.close()
        self._channel = None
        tiers.FORKED_CPU[0] += status["cpu"]
        self.returncode = status["code"]

    def _internal_poll(self, _deadstate=None, **kwargs):
        if self._channel is None:  # a plain child, or a forked run whose exit is known
            return super()._internal_poll(_deadstate, **kwargs)
        try:
            self._status(0)
        except subprocess.TimeoutExpired:
            pass
        return self.returncode

    def _wait(self, timeout):
        if self._channel is None:
            return super()._wait(timeout)
        self._status(timeout)
        return self.returncode


def install() -> None:
    """Start ``python -m slime_mt.cli`` commands of this process from the server (unless
    ``SLIME_MT_TEST_FORKSERVER=0``)."""
    if os.environ.get("SLIME_MT_TEST_FORKSERVER", "1") != "0" and sys.platform.startswith("linux"):
        subprocess.Popen = Popen


if __name__ == "__main__":
    serve(sys.argv[1])
