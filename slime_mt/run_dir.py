"""The run folder explains itself: what the run was asked (``config.yaml``), what it printed
(``train.log``), what went wrong (``errors.jsonl``), next to ``metrics.jsonl`` and the checkpoints.

``config.yaml`` is the resolved configuration, one section per concern; ``slime-mt train --config
RUN_DIR/config.yaml`` runs the same settings again. ``train.log`` receives everything the main
process prints (stdout, stderr, log records), as the terminal shows it.

One run per folder: ``claim_run_dir`` locks it for the run's life (a second run into it stops at
once), and a folder that holds an earlier run's files is refused unless ``--load`` resumes that run
(its files then go on) or ``--overwrite-run-dir`` starts over (the earlier files are moved into
``RUN_DIR/earlier-<time>/``, nothing deleted).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from slime_mt.config import Config
from slime_mt.errors import RunDirError

CONFIG_FILE = "config.yaml"
LOG_FILE = "train.log"
ERRORS_FILE = "errors.jsonl"
LOCK_FILE = ".run.lock"
# what a run writes into its folder: an earlier run's, found there, would mix with this one's
RUN_FILES = (CONFIG_FILE, LOG_FILE, ERRORS_FILE, "metrics.jsonl", "turns.jsonl", "trace.json")
RUN_OUTPUTS = (*RUN_FILES, "tensorboard", "logs", "weights", "report.html", "viewer.html")
CHECKPOINT_OUTPUTS = ("latest",)  # and iter_*


def run_dir_of(cfg: Config) -> Path:
    """``--log-dir``, else ``--save``, else a new temporary folder."""
    return Path(cfg.checkpoint.log_dir or cfg.checkpoint.save or tempfile.mkdtemp(prefix="slime-mt-run-"))


def write_config(run_dir: Path, cfg: Config) -> Path:
    """``RUN_DIR/config.yaml``, written whole (temp file, then rename)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(cfg.to_yaml())
    os.replace(tmp, path)
    return path


def claim_run_dir(run_dir: Path, cfg: Config):
    """Lock ``run_dir`` for this run (the open lock file, held until ``release_run_dir`` or the process
    ends; a lock file naming an owner that is gone is taken over, with a note) and refuse it when it holds
    an earlier run that ``--load`` does not resume, unless ``--overwrite-run-dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "another process"
        lock.close()
        raise RunDirError(
            f"run folder {run_dir} is in use by another run ({owner}); give each run its own --log-dir"
        ) from None
    lock.seek(0)
    gone = lock.read().strip()
    if gone:  # its owner ended without releasing it: killed, or its machine lost
        print(f"slime-mt train: run folder {run_dir}: taking over the lock of {gone}, which is gone", file=sys.stderr)
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    lock.flush()
    if cfg.checkpoint.load:
        return lock  # a resumed run goes on in its folder
    earlier = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    save = Path(cfg.checkpoint.save) if cfg.checkpoint.save else None
    if save is not None and (save / "latest").exists():
        earlier.append(save / "latest")
    if not earlier:
        return lock
    if not cfg.checkpoint.overwrite_run_dir:
        lock.close()
        names = ", ".join(str(p.relative_to(run_dir)) if p.is_relative_to(run_dir) else str(p) for p in earlier)
        raise RunDirError(
            f"run folder {run_dir} holds an earlier run ({names}): resume it with --load "
            f"{save or '<its --save folder>'}, start over with --overwrite-run-dir (its files move to "
            f"{run_dir}/earlier-<time>/, nothing is deleted), or give this run another --log-dir"
        )
    _move_aside(run_dir, save)
    return lock


def release_run_dir(lock) -> None:
    """The run ends: its lock file is emptied (no owner named) and released. The file stays: removing it
    could let two later runs each lock a file of their own."""
    with contextlib.suppress(OSError):
        lock.seek(0)
        lock.truncate()
        lock.flush()
    lock.close()


def _move_aside(run_dir: Path, save: Path | None) -> Path:
    """Move an earlier run's outputs (and its checkpoints in ``save``) into ``RUN_DIR/earlier-<time>/``."""
    aside = run_dir / time.strftime("earlier-%Y%m%d-%H%M%S")
    aside.mkdir()
    moved = [run_dir / name for name in RUN_OUTPUTS]
    moved += [p for p in run_dir.glob("*.png")]
    if save is not None and save.is_dir():
        checkpoints = [save / name for name in CHECKPOINT_OUTPUTS] + sorted(save.glob("iter_*"))
        (aside / "checkpoints").mkdir()
        moved += [(p, aside / "checkpoints" / p.name) for p in checkpoints]
    for item in moved:
        source, target = item if isinstance(item, tuple) else (item, aside / item.name)
        if source.exists():
            os.replace(source, target)
    print(f"slime-mt train: the earlier run's files were moved to {aside}", file=sys.stderr)
    return aside


class _Tee:
    """A text stream that writes to the stream it replaces and to the log file."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        self._log.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._log.flush()
        self._stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding: the terminal's
        return getattr(self._stream, name)


@contextlib.contextmanager
def tee_output(path: Path) -> Iterator[None]:
    """Everything this process prints (stdout, stderr and the log handlers writing to them) also goes
    to ``path`` (appended, line-buffered) until the block ends."""
    log = open(path, "a", buffering=1)
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
    handlers = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and h.stream in (out, err) and not isinstance(h, logging.FileHandler)
    ]
    streams = [h.setStream(sys.stdout if h.stream is out else sys.stderr) for h in handlers]
    try:
        yield
    finally:
        for handler, stream in zip(handlers, streams):
            handler.setStream(stream)
        sys.stdout, sys.stderr = out, err
        log.close()
