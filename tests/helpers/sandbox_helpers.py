"""What the sandbox tests share: small limits (the limits-only mode allowed, so that it is tested too), a
run with its wall time, and the sandbox's processes still alive."""

import asyncio
import glob
import time

from tiers import MISSING

from envs.sandbox import SandboxLimits, run_python, sandbox_mode

# allow_unisolated: the limits-only mode is tested too (refused without it: see the isolation tests)
LIMITS = SandboxLimits(
    cpu_seconds=2, wall_seconds=5, memory_mb=256, file_mb=8, workdir_mb=32, output_bytes=2048, allow_unisolated=True
)
ISOLATED = sandbox_mode() == "isolated"
NO_USERNS = MISSING + "unprivileged user namespaces (the sandbox's isolated mode)"  # fails under CI=true


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
