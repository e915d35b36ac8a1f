"""The run folder explains itself: what the run was asked (``config.yaml``), what it printed
(``train.log``), what went wrong (``errors.jsonl``), next to ``metrics.jsonl`` and the checkpoints.

``config.yaml`` is the resolved configuration, one section per concern; ``slime-mt train --config
RUN_DIR/config.yaml`` runs the same settings again. ``train.log`` receives everything the main
process prints (stdout, stderr, log records), as the terminal shows it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from slime_mt.config import Config

CONFIG_FILE = "config.yaml"
LOG_FILE = "train.log"
ERRORS_FILE = "errors.jsonl"


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
