"""Hugging Face safetensors folders, read a slice at a time and written a shard at a time.

``CheckpointReader`` reads tensors, or only the rows or columns a rank holds, from a folder (one file or
shards with ``model.safetensors.index.json``) or from an in-memory dict; ``ShardWriter`` writes named
tensors as shards of at most 2 GB with their index, as transformers does. The trainer (initial weights,
checkpoints, exports) and the engines (weight folders, FP8 copies) both read and write through them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _SafetensorsFile:
    """Positional reads of one safetensors file: only the bytes of the requested rows are read (no
    mmap, so a rank's memory holds what it asked for and nothing of the rest of the file)."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self.base = 8 + size
        self.entries = header

    def shape(self, name: str) -> list[int]:
        return list(self.entries[name]["shape"])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dim 0 (the whole tensor for a 0-d or when the range covers it)."""
        entry = self.entries[name]
        dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
        begin, _ = entry["data_offsets"]
        row = (torch.Size(shape[1:]).numel() if shape else 1) * torch.empty(0, dtype=dtype).element_size()
        count = (stop - start) * row if shape else row
        buffer = bytearray(count)
        with open(self.path, "rb") as f:
            f.seek(self.base + begin + start * row)
            if f.readinto(buffer) != count:
                raise ValueError(f"{self.path}: tensor {name} is truncated")
        if count == 0:
            return torch.empty([stop - start, *shape[1:]], dtype=dtype)
        tensor = torch.frombuffer(buffer, dtype=dtype)
        return tensor.reshape([stop - start, *shape[1:]] if shape else [])


class CheckpointReader:
    """Lazy, sliceable access to the tensors of an HF safetensors folder (or of an in-memory dict):
    ``get`` reads a whole tensor, ``rows``/``cols`` only a slice, so a TP rank reads its shard."""

    def __init__(
        self,
        path: str | Path | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        block_bytes: int = 64 * 1024 * 1024,
    ):
        self._tensors = dict(tensors) if tensors is not None else None
        self._where: dict[str, _SafetensorsFile] = {}
        self.block_bytes = block_bytes
        if path is not None:
            folder = Path(path)
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {path}")
            index = folder / "model.safetensors.index.json"
            if index.is_file():
                files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
            for file in files:
                handle = _SafetensorsFile(file)
                for name in handle.entries:
                    self._where[name] = handle

    def names(self) -> set[str]:
        return set(self._tensors) if self._tensors is not None else set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def _file(self, name: str) -> _SafetensorsFile:
        if name not in self._where:
            raise KeyError(f"{name} is not in the checkpoint")
        return self._where[name]

    def shape(self, name: str) -> list[int]:
        return list(self._tensors[name].shape) if self._tensors is not None else self._file(name).shape(name)

    def get(self, name: str) -> torch.Tensor:
        if self._tensors is not None:
            return self._tensors[name].clone()
        shape = self.shape(name)
        return self._file(name).rows(name, 0, shape[0] if shape else 1)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if self._tensors is not None:
            return self._tensors[name][start:stop].clone()
        return self._file(name).rows(name, start, stop)

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` of a 2-D tensor, read a block of rows at a time."""
        if self._tensors is not None:
            return self._tensors[name][:, start:stop].contiguous()
        rows, width = self.shape(name)
        file = self._file(name)
        step = max(1, self.block_bytes // max(width * file.rows(name, 0, 0).element_size(), 1))
        return (
            torch.cat([file.rows(name, r, min(r + step, rows))[:, start:stop].clone() for r in range(0, rows, step)])
            if rows
            else file.rows(name, 0, 0)[:, start:stop]
        )


def load_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder (tests and tools; training reads slices)."""
    reader = CheckpointReader(path)
    return {name: reader.get(name) for name in sorted(reader.names())}


class ShardWriter:
    """Writes (name, tensor) pairs as HF safetensors shards of at most ``max_bytes`` each:
    ``{prefix}.safetensors`` when one shard suffices, else ``{prefix}-0000i-of-0000n.safetensors`` and
    ``{prefix}.safetensors.index.json``. Holds at most one shard in memory."""

    def __init__(self, folder: str | Path, prefix: str = "model", max_bytes: int = 2 * 1024**3):
        self.folder, self.prefix, self.max_bytes = Path(folder), prefix, max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._size = 0
        self._shards: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._size + size > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._size += size

    def _flush(self) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        path = self.folder / f".{self.prefix}-part{len(self._shards):05d}.safetensors"
        try:
            save_file(self._pending, str(path))
        except SafetensorError as e:  # its I/O errors carry the OS's errno only in the text
            found = re.search(r"os error (\d+)", str(e))
            if found is None:
                raise
            raise OSError(int(found.group(1)), f"{os.strerror(int(found.group(1)))}: {path}") from e
        self._shards.append((path, list(self._pending)))
        self._pending, self._size = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard and the index; -> the shard files."""
        if self._pending or not self._shards:
            self._flush()
        if len(self._shards) == 1:
            final = self.folder / f"{self.prefix}.safetensors"
            self._shards[0][0].rename(final)
            return [final]
        n = len(self._shards)
        weight_map, files = {}, []
        for i, (path, names) in enumerate(self._shards):
            final = self.folder / f"{self.prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(final)
            files.append(final)
            weight_map.update({name: final.name for name in names})
        (self.folder / f"{self.prefix}.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
        )
        return files
