"""Inside a sandbox, before the model's code runs (standard library only: run as a script by path).

``python -I -S _sandbox_init.py CONFIG_JSON``. With ``isolate`` (the process is the first of fresh
user, mount, network and PID namespaces, see ``python_sandbox.py``) it builds a new root on a
size-limited tmpfs mounted over the run's empty host folder: the interpreter's folders and the
system's library folders bound read-only at their own paths, ``/dev`` with null/zero/urandom, a fresh
``/proc`` (and the namespace's ``pid_max``, which bounds its processes where the kernel keeps one per
namespace, 6.14+), the code in ``/sandbox``; then it moves into that root (``pivot_root``, the old root
detached, so nothing else of the host is reachable) and gives up every capability. In every mode it
sets the resource limits and the lowest CPU share (nice 19, SCHED_IDLE, no way back), clears the
environment, gives up every capability (where it has any: as root without namespaces too) and executes
the interpreter on the code.
"""

import ctypes
import json
import os
import platform
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 38, 24, 28
CHANNEL_FD = 3

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else str(s).encode()  # noqa: E731
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def bind(source: str, root: str, writable: bool = False) -> None:
    """Bind ``source`` at the same path under ``root``, read-only unless ``writable``."""
    target = root + source
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    if not writable:
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(config: dict) -> None:
    root = config["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    mount("sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['workdir_bytes']},mode=0755")
    for path in config["read_only"]:
        if os.path.lexists(root + path):
            continue  # under a folder bound already
        if os.path.islink(path):  # /lib -> usr/lib on merged-/usr systems, an env reached through a link
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)  # its target is in read_only too
        elif os.path.exists(path):
            bind(path, root)
    os.makedirs(root + "/dev", exist_ok=True)
    for device in ("null", "zero", "urandom", "random"):
        bind(f"/dev/{device}", root, writable=True)
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV)
    if config["pid_max"]:
        try:
            with open(root + "/proc/sys/kernel/pid_max", "w") as fh:
                fh.write(str(config["pid_max"]))
        except OSError:
            pass  # a kernel without a pid_max per namespace: RLIMIT_NPROC (and the wall time) bound it
    os.makedirs(root + config["workdir"], exist_ok=True)
    os.makedirs(root + "/tmp", exist_ok=True)
    os.makedirs(root + "/.old", exist_ok=True)
    number = PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"no pivot_root for {platform.machine()}")
    check(libc.syscall(number, root.encode(), (root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.old", MNT_DETACH), "umount the old root")
    os.rmdir("/.old")
    mount(None, "/proc", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # pid_max stays put


def drop_privileges() -> None:
    """No capability survives the exec, none can be regained (root of the namespace or not). A process
    that has none to give up (a user other than root, without namespaces) only sets no_new_privs."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows (or none to drop: no CAP_SETPCAP)
    # noroot + noroot_locked + no_setuid_fixup + no_setuid_fixup_locked + keep_caps_locked
    if libc.prctl(PR_SET_SECUREBITS, 0x1 | 0x2 | 0x4 | 0x8 | 0x20, 0, 0, 0) != 0 and os.geteuid() == 0:
        check(-1, "securebits")  # root that cannot give up its capabilities: the sandbox fails
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def run_code(config: dict, workdir: str) -> None:
    """In the child: limits, privileges, a clean environment, then the interpreter on main.py."""
    os.chdir(workdir)
    if config["channel_fd"] is not None:  # the channel to the host, at fd 3 for the code
        if config["channel_fd"] != CHANNEL_FD:
            os.dup2(config["channel_fd"], CHANNEL_FD)
            os.close(config["channel_fd"])
        os.set_inheritable(CHANNEL_FD, True)
    # the lowest CPU share there is, for good: nice 19, no way back (RLIMIT_NICE 0), and SCHED_IDLE (it
    # runs only on a core nothing else wants), so spinning processes cannot starve the rollout's
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    for name, value in config["rlimits"].items():
        # the CPU limit's soft value sends SIGXCPU (named in the result); a second more, SIGKILL
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
    drop_privileges()
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    if not config["isolate"]:
        env["TMPDIR"] = workdir
    os.execve(config["python"], [config["python"], "-I", "main.py"], env)


def main() -> None:
    """Set up, run the code as a child, reap every process that ends meanwhile (under isolation this
    is the namespace's first process, its init), then report the code's wait status on the status
    pipe; when this process exits the kernel ends whatever is left in the namespace."""
    config = json.loads(sys.argv[1])
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)
    if config["isolate"]:
        build_root(config)
        workdir = config["workdir"]
    else:
        workdir = config["root"]
    with open(os.path.join(workdir, "main.py"), "w") as fh:
        fh.write(config["code"])
    for name, text in config["files"].items():
        with open(os.path.join(workdir, name), "w") as fh:
            fh.write(text)
    child = os.fork()
    if child == 0:
        try:
            run_code(config, workdir)
        except BaseException as e:  # said on the status pipe: the sandbox's failure, not the code's
            os.write(status_fd, f"start-failed {type(e).__name__}: {e}"[:1000].replace("\n", " ").encode() + b"\n")
        os._exit(127)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            status = 127 << 8
            break
        if pid == child:
            break
    os.write(status_fd, f"{status}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    main()
