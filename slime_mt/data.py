"""Prompt datasets: jsonl/parquet rows -> prompt groups of Samples, with a saveable cursor.

A row gives the prompt (``--input-key``: a string or a list of chat messages), the reference answer
(``--label-key``), a metadata dict (``--metadata-key``), tools (``--tool-key``) and images
(``--multimodal-keys '{"image": "images"}'``: paths relative to the data file, base64 strings or data
URIs). ``<image>`` placeholders in the prompt text are paired in order with the row's images and
become image content parts. A row whose placeholders and images disagree, or whose image cannot be
read, is a DatasetError naming the row and the file. Rows are numbered from 1 in every message: a
.jsonl row by its line (what an editor shows), a .parquet row by its position.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from slime_mt.config import DataConfig
from slime_mt.errors import DatasetError
from slime_mt.types import Sample

IMAGE_PLACEHOLDER = "<image>"
DEFAULT_LABEL_KEY = "label"  # read where a row has it when --label-key is not given

logger = logging.getLogger(__name__)


@dataclass
class PromptRow:
    index: int
    prompt: str | list[dict]
    label: Any = None
    metadata: dict = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)
    where: str = ""  # "row 3 of train.jsonl", as data errors name it


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    """Write ``rows`` as jsonl, whole or not at all (a temporary file renamed into place); makes the
    folder -> the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)
    return path


def read_records(path: str | Path) -> list[tuple[int, Any]]:
    """Rows of a .jsonl or .parquet file -> (row number from 1, record): a .jsonl row's number is its
    line (blank lines are skipped but counted)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"prompt data file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), 1))
    if path.suffix not in (".jsonl", ".json"):
        raise DatasetError(f"{path}: unsupported prompt data format {path.suffix!r}; use .jsonl or .parquet")
    rows = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"row {lineno} of {path.name}: not valid JSON ({e.msg})") from None
    return rows


def _image_value(value: Any) -> Any:
    """Parquet image columns are often {"bytes": ..., "path": ...} structs."""
    if isinstance(value, dict) and value.get("bytes") is not None:
        return Image.open(io.BytesIO(value["bytes"]))
    if isinstance(value, dict) and value.get("path"):
        return value["path"]
    return value


def _load_image(value: Any, base_dir: Path, where: str) -> Image.Image:
    value = _image_value(value)
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, str) and value.startswith("data:"):
            image = Image.open(io.BytesIO(base64.b64decode(value.partition(",")[2], validate=True)))
        elif isinstance(value, str) and (
            os.path.isabs(value)
            or (base_dir / value).exists()
            or "/" in value
            or value.lower().endswith((".png", ".jpg", ".jpeg", ".webp", ".gif"))
        ):
            image = Image.open(value if os.path.isabs(value) else base_dir / value)
        elif isinstance(value, str):
            image = Image.open(io.BytesIO(base64.b64decode(value, validate=True)))
        else:
            raise DatasetError(f"{where}: image must be a path, base64 string or data URI, got {type(value).__name__}")
        image.load()
        return image.convert("RGB")
    except DatasetError:
        raise
    except Exception as e:
        shown = value if isinstance(value, str) and len(value) < 80 else f"<{type(value).__name__}>"
        raise DatasetError(f"{where}: cannot read image {shown!r}: {type(e).__name__}: {e}") from None


def _with_image_parts(text: str, images: list) -> list[dict] | str:
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) == 1:
        return text
    parts: list[dict] = []
    for k, piece in enumerate(pieces):
        if piece:
            parts.append({"type": "text", "text": piece})
        if k < len(pieces) - 1:
            parts.append({"type": "image", "image": images.pop(0)})
    return parts


def _count_placeholders(prompt: Any) -> int:
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in prompt if isinstance(m.get("content"), str))


def load_rows(path: str | Path, cfg: DataConfig, limit: int | None = None) -> list[PromptRow]:
    """Validate every row of ``path`` (the first ``limit``) into a PromptRow (images decoded,
    placeholders paired). Every key the flags name must be in every row: ``--input-key``, ``--tool-key``,
    ``--label-key`` (not given: ``label`` is read where a row has it, and a warning counts the rows without) and the
    image key of ``--multimodal-keys`` in a row with ``<image>`` placeholders."""
    path = Path(path)
    records = read_records(path)[:limit]
    if not records:
        raise DatasetError(f"{path}: no rows")
    image_key = (cfg.multimodal_keys or {}).get("image")
    rows = []
    unlabelled = 0
    label_key = cfg.label_key or DEFAULT_LABEL_KEY
    for i, (number, record) in enumerate(records):
        where = f"row {number} of {path.name}"
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: expected an object, got {type(record).__name__}")
        for key, flag in ((cfg.input_key, "--input-key"), (cfg.tool_key, "--tool-key")):
            if key and key not in record:
                raise DatasetError(f"{where}: no key '{key}' ({flag}); the row's keys: {sorted(record)}")
        if label_key not in record:
            if cfg.label_key:
                raise DatasetError(f"{where}: no key '{label_key}' (--label-key); the row's keys: {sorted(record)}")
            unlabelled += 1
        prompt = record[cfg.input_key]
        if isinstance(prompt, str):
            pass
        elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            prompt = [dict(m) for m in prompt]
        else:
            raise DatasetError(f"{where}: prompt '{cfg.input_key}' must be a string or a list of chat messages")
        raw_images = record.get(image_key) if image_key else None
        raw_images = list(raw_images) if raw_images is not None else []
        placeholders = _count_placeholders(prompt)
        if placeholders and image_key and image_key not in record:
            raise DatasetError(
                f"{where}: {placeholders} {IMAGE_PLACEHOLDER} placeholders but no key '{image_key}' "
                f"(--multimodal-keys); the row's keys: {sorted(record)}"
            )
        if placeholders != len(raw_images):
            raise DatasetError(f"{where}: {placeholders} {IMAGE_PLACEHOLDER} placeholders but {len(raw_images)} images")
        images = [_load_image(v, path.parent, f"{where}, image {k}") for k, v in enumerate(raw_images)]
        pending = list(images)
        if isinstance(prompt, str):
            prompt = _with_image_parts(prompt, pending)
        else:
            for message in prompt:
                if isinstance(message["content"], str):
                    message["content"] = _with_image_parts(message["content"], pending)
        metadata = record.get(cfg.metadata_key) or {}
        if isinstance(metadata, str):
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError:
                raise DatasetError(f"{where}: metadata '{cfg.metadata_key}' is a string but not JSON") from None
        if not isinstance(metadata, dict):
            raise DatasetError(f"{where}: metadata '{cfg.metadata_key}' must be an object")
        metadata = dict(metadata)
        if cfg.tool_key and record.get(cfg.tool_key):
            tools = record[cfg.tool_key]
            metadata["tools"] = json.loads(tools) if isinstance(tools, str) else tools
        label = record.get(label_key)
        rows.append(PromptRow(i, prompt, label, metadata, images, where))
    if unlabelled:
        logger.warning(
            "%s: %d of %d rows have no '%s' key: their samples get label None (--label-key names the key, "
            "and makes it required)",
            path.name,
            unlabelled,
            len(records),
            DEFAULT_LABEL_KEY,
        )
    return rows


class PromptDataset:
    """Prompt groups in epoch order (reshuffled per epoch when ``shuffle``), with a saveable cursor."""

    def __init__(self, rows: list[PromptRow], n_samples_per_prompt: int, shuffle: bool = False, seed: int = 0):
        self.rows = rows
        self.n = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self.next_group = 0
        self.requeued: list[tuple[int, int]] = []  # (row, group index) drawn but never trained: drawn again first
        self.sample_class: type[Sample] = Sample  # --slime-compat: slime's Sample (a subclass)
        self._order = self._epoch_order()

    @classmethod
    def from_config(cls, path: str, cfg: DataConfig, n_samples_per_prompt: int) -> PromptDataset:
        return cls(load_rows(path, cfg), n_samples_per_prompt, cfg.rollout_shuffle, cfg.rollout_seed)

    def keep_rows(self, keep) -> list[PromptRow]:
        """Keep the rows for which ``keep(row)`` holds (before the first draw) -> the rows left out."""
        dropped = [row for row in self.rows if not keep(row)]
        self.rows = [row for row in self.rows if keep(row)]
        self._order = self._epoch_order()
        return dropped

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        """The next ``num_prompts`` prompts, each as a group of ``n_samples_per_prompt`` Samples."""
        groups = []
        for _ in range(num_prompts):
            if self.requeued:
                position, group_index = self.requeued.pop(0)
                groups.append(self._group(self.rows[position], group_index))
                continue
            if self.cursor >= len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order()
            groups.append(self._group(self.rows[self._order[self.cursor]], self.next_group))
            self.cursor += 1
            self.next_group += 1
        return groups

    def _group(self, row: PromptRow, group_index: int) -> list[Sample]:
        return [
            self.sample_class(
                index=group_index * self.n + k,
                group_index=group_index,
                prompt=_copy_prompt(row.prompt),
                label=row.label,
                metadata={**row.metadata, "row": row.index},
                multimodal_inputs={"images": list(row.images)} if row.images else None,
            )
            for k in range(self.n)
        ]

    def state_dict(self, untrained: list[list[Sample]] = ()) -> dict:
        """The cursor; ``untrained``: groups drawn but never trained (a fully-async run's buffer and
        groups in flight, at a checkpoint), which a loaded dataset draws first, same rows and group
        indices."""
        pairs = [[int(g[0].metadata["row"]), int(g[0].group_index)] for g in untrained]
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "next_group": self.next_group,
            "requeued": pairs + [list(pair) for pair in self.requeued],
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self.next_group = state["epoch"], state["cursor"], state["next_group"]
        self.requeued = [(int(p), int(g)) for p, g in state.get("requeued", [])]
        self._order = self._epoch_order()


def _copy_prompt(prompt: Any) -> Any:
    """Copy the message structure so samples never share lists; images (read-only) are shared."""
    if isinstance(prompt, list):
        return [_copy_prompt(p) for p in prompt]
    if isinstance(prompt, dict):
        return {k: _copy_prompt(v) for k, v in prompt.items()}
    return prompt
