"""Build-once cache for offline assets under ``SLIME_MT_CACHE`` (default ``~/.cache/slime_mt``).

``cached_dir(name, build)`` returns ``<cache>/<name>``; the first caller builds it into a temp dir
and renames it into place under an exclusive file lock, so two processes building at the same
time get one complete copy and a crash never leaves a half-written asset behind.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    root = Path(os.environ.get("SLIME_MT_CACHE", Path.home() / ".cache" / "slime_mt")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def cached_dir(name: str, build: Callable[[Path], None]) -> Path:
    """Return ``<cache>/<name>``, calling ``build(tmp_dir)`` once to create it."""
    root = cache_root()
    final = root / name
    if final.is_dir():
        return final
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():  # built by another process while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by the user's tools
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
