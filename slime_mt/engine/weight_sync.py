"""Weights for engines outside the trainer's process: one safetensors folder per version on disk.

``WeightFolders`` writes ``ROOT/v{N}`` for version N (to ``ROOT/.tmp_v{N}`` first, then renamed, so
an engine never reads half a folder) and deletes what no engine needs: once every engine has
acknowledged version N (``update_weights_from_disk`` answered success on each), only v{N} and the
``keep`` versions before it stay (``--keep-weight-versions``, default 1). Each folder is a full
model, about 15 GB for a 7B model in bf16, so without this a run fills its disk.

A folder is never deleted while an engine may read it: deletion only follows every engine's
acknowledgement of a newer version (a load reads its folder within the update call), and an
update that fails on any engine deletes nothing. Folders an earlier run left in ROOT (a resumed run
in the same run directory) are deleted when the run starts: no update is reading them then.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class WeightFolders:
    def __init__(self, root: str | Path, keep: int = 1):
        if keep < 0:
            raise ValueError(f"--keep-weight-versions must be >= 0, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self._versions: list[int] = []  # written by this run and not deleted, oldest first
        self.root.mkdir(parents=True, exist_ok=True)
        stale = sorted(p for p in self.root.iterdir() if p.is_dir() and _is_version(p.name.removeprefix(".tmp_")))
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        if stale:
            logger.info("deleted %d weight folders an earlier run left in %s", len(stale), self.root)

    def folder(self, version: int) -> Path:
        return self.root / f"v{version}"

    def write(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> Path:
        """Write HF-named ``tensors`` as version ``version`` -> its folder (complete when it appears)."""
        from slime_mt.backends.megatron.convert import ShardWriter

        folder, tmp = self.folder(version), self.root / f".tmp_v{version}"
        shutil.rmtree(tmp, ignore_errors=True)
        writer = ShardWriter(tmp, "model")
        for name, tensor in tensors:
            writer.add(name, tensor)
        writer.close()
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        if version not in self._versions:
            self._versions.append(version)
        return folder

    def acknowledged(self, version: int) -> list[Path]:
        """Every engine serves ``version``: delete the folders of older versions beyond the ``keep``
        before it -> the folders deleted."""
        older = [v for v in self._versions if v < version]
        deleted = []
        for v in older[: max(len(older) - self.keep, 0)]:
            shutil.rmtree(self.folder(v), ignore_errors=True)
            self._versions.remove(v)
            deleted.append(self.folder(v))
        return deleted

    def kept(self) -> list[Path]:
        return [self.folder(v) for v in self._versions]


def _is_version(name: str) -> bool:
    return name.startswith("v") and name[1:].isdigit()
