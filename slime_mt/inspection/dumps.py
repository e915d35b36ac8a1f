"""Rollout dumps: every step's samples on disk (slime's ``--save-debug-rollout-data`` /
``--load-debug-rollout-data``), to read, to inspect (``slime-mt inspect``) and to train on again.

``--save-debug-rollout-data PATH`` (``{rollout_id}`` in PATH is the step, as in slime) writes, per step,
``PATH`` and, when the step has images, ``PATH`` minus its suffix plus ``.images/`` beside it (PNG files
the records name, relative to the dump's folder). ``PATH`` is a ``torch.save`` of plain data and
tensors that ``torch.load(PATH, weights_only=True)`` reads without slime_mt: ``format``
(``slime_mt.rollout_dump``), ``version`` (1), ``rollout_id``, ``created`` (unix time), ``records`` (JSON
text: ``samples``, ``train`` and ``settings`` below; JSON because torch's safe loader reads large nested
lists 7 times slower at 10,000 trajectories, benchmarks/inspect_page.py) and ``tensors`` (each by its
place in the records, such as ``samples/3/multimodal_train_inputs/pixel_values`` or
``train/0/routed_experts``). ``load_dump`` puts them together:

  samples       one dict per trajectory, in group order: index, group_index, prompt, tokens, response,
                response_length, prompt_length, label, reward, loss_mask, rollout_log_probs,
                token_versions, weight_versions, status, metadata (JSON-safe), images (file names),
                multimodal_train_inputs (tensors), routed_experts (a tensor under
                --use-rollout-routing-replay, else None; ``slime_mt/routes.py``), and turns: one dict
                per LLM call with output_start,
                output_end, observation_end, context_ids (when the context was rewritten),
                image_indices, finish_reason, weight_version, engine_seconds, env_seconds,
                env_retries, env_info, num_images, reward
  train         what the step trained (``types.TrainBatch``): samples (the finalized sequences:
                prompt_ids, response_ids, loss_mask, rollout_log_probs, token_versions, reward,
                trajectory_id = "group/index", group_id, is_last_step, turns (the trajectory's turns the
                sequence holds; None: all), stop_reason, status, multimodal_train_inputs,
                routed_experts, and train_log_probs: the trainer's log-probs of its response tokens
                under the weights the step started from, at the rollout temperature, written after
                the step trained, None when it did not train), advantages (one per sequence),
                merge_metrics, rollout_metrics, metrics, rollout_seconds,
                rollout_started, trained_groups, note
  settings      the settings the sequences and advantages were made with (sample format, merge,
                advantage estimator, ...)
  eval          only in the dump of an evaluation (PATH with ``{rollout_id}`` = ``eval_N``, as slime
                names it; N the steps trained before it, 0 for the baseline): after_steps (N) and
                datasets ([name, trajectories] in the order of ``samples``); its ``train`` is empty

``load_dump`` gives the plain form back; ``samples_of`` and ``train_batch_of`` the project's types. A
dump is written whole (temp file, then rename), images first.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from slime_mt.errors import DumpError

FORMAT = "slime_mt.rollout_dump"
VERSION = 1
SETTINGS = (
    ("rollout", "sample_format"),
    ("rollout", "merge_step_wise"),
    ("rollout", "mask_truncated"),
    ("rollout", "mask_offpolicy_in_partial_rollout"),
    ("rollout", "max_staleness"),
    ("algo", "advantage_estimator"),
    ("algo", "normalize_advantages_std"),
    ("algo", "normalize_advantages"),
)


def images_dir(path: Path) -> Path:
    return path.with_name(path.stem + ".images")


# the ``train`` records of an evaluation's dump
NOTHING_TRAINED = {
    "samples": [],
    "advantages": [],
    "merge_metrics": {},
    "rollout_metrics": {},
    "metrics": {},
    "rollout_seconds": 0.0,
    "rollout_started": 0.0,
    "trained_groups": [],
    "note": "",
}


def settings_of(cfg) -> dict:
    return {name: getattr(getattr(cfg, group), name) for group, name in SETTINGS}


def _image_bytes(image: Any) -> bytes:
    if isinstance(image, str) and image.startswith("data:"):
        return base64.b64decode(image.partition(",")[2])
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _write_images(sample, folder: Path, relative_to: Path) -> list[str]:
    """The trajectory's images in context order (``image_data``: the prompt's, then the observations';
    a turn's ``image_indices`` index it) as PNG files -> their names relative to the dump's folder."""
    inputs = sample.multimodal_inputs or {}
    images = inputs.get("image_data") or inputs.get("images") or []
    names = []
    for k, image in enumerate(images):
        path = folder / f"sample{sample.index}_{k}.png"
        folder.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_image_bytes(image))
        names.append(str(path.relative_to(relative_to)))
    return names


def sample_record(sample, images: list[str]) -> dict:
    """A Sample as the records hold it (see the module docstring); ``save_dump`` writes what JSON cannot
    hold (a prompt's images, a label object) as its repr."""
    return {
        "index": sample.index,
        "group_index": sample.group_index,
        "prompt": sample.prompt,
        "tokens": list(sample.tokens),
        "response": sample.response,
        "response_length": sample.response_length,
        "prompt_length": sample.prompt_length,
        "label": sample.label,
        "reward": sample.reward,
        "loss_mask": list(sample.loss_mask),
        "rollout_log_probs": None if sample.rollout_log_probs is None else list(sample.rollout_log_probs),
        "token_versions": None if sample.token_versions is None else list(sample.token_versions),
        "weight_versions": list(sample.weight_versions),
        "status": getattr(sample.status, "value", sample.status),
        "metadata": sample.metadata,
        "images": images,
        "multimodal_train_inputs": _tensors(sample.multimodal_train_inputs),
        "routed_experts": sample.routed_experts,
        "turns": [dataclasses.asdict(t) for t in sample.turns],
    }


def _tensors(value: dict | None) -> dict | None:
    if not value:
        return None
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in value.items()}


def training_record(ts, advantage: float) -> dict:
    record = {f.name: getattr(ts, f.name) for f in dataclasses.fields(ts)}
    record["status"] = getattr(ts.status, "value", ts.status)
    record["multimodal_train_inputs"] = _tensors(ts.multimodal_train_inputs)
    record["advantage"] = float(advantage)
    record["train_log_probs"] = None  # add_train_log_probs fills it once the step has trained
    return record


def save_dump(path: Path, step: int, groups: list[list], batch, settings: dict) -> Path:
    """Write step ``step``'s dump: the trajectories of ``groups``, the TrainBatch ``batch`` it trains."""
    train = {
        "samples": [training_record(ts, a) for ts, a in zip(batch.samples, batch.advantages)],
        "advantages": [float(a) for a in batch.advantages],
        "merge_metrics": dict(batch.merge_metrics),
        "rollout_metrics": dict(batch.rollout_metrics),
        "metrics": dict(batch.metrics),
        "rollout_seconds": batch.rollout_seconds,
        "rollout_started": batch.rollout_started,
        "trained_groups": list(batch.trained_groups),
        "note": batch.note,
    }
    return _write_dump(Path(path), step, [s for g in groups for s in g], {"train": train, "settings": settings})


def save_eval_dump(path: Path, steps_trained: int, datasets: list[tuple[str, list[list]]], settings: dict) -> Path:
    """Write the dump of the evaluation after ``steps_trained`` steps: each dataset's groups, by name, in
    the order given (``eval.datasets`` names them and counts their trajectories); nothing was trained."""
    eval_ = {"after_steps": steps_trained, "datasets": [[name, sum(map(len, groups))] for name, groups in datasets]}
    train = dict(NOTHING_TRAINED)
    samples = [s for _, groups in datasets for g in groups for s in g]
    return _write_dump(Path(path), steps_trained, samples, {"train": train, "settings": settings, "eval": eval_})


def _write_dump(path: Path, rollout_id: int, trajectories: list, records: dict) -> Path:
    """The dump of ``trajectories`` (Samples, their images beside it) with the rest of its ``records``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = images_dir(path)
    samples = [sample_record(s, _write_images(s, folder, path.parent)) for s in trajectories]
    tensors: dict[str, torch.Tensor] = {}
    for where, rows in (("samples", samples), ("train", records["train"]["samples"])):
        for i, record in enumerate(rows):
            for key, value in (record["multimodal_train_inputs"] or {}).items():
                tensors[f"{where}/{i}/multimodal_train_inputs/{key}"] = value
            if record["multimodal_train_inputs"]:
                record["multimodal_train_inputs"] = {key: None for key in record["multimodal_train_inputs"]}
            if isinstance(record.get("routed_experts"), torch.Tensor):  # R3 routes: kept as tensors too
                tensors[f"{where}/{i}/routed_experts"] = record["routed_experts"].detach().cpu()
                record["routed_experts"] = None
    data = {
        "format": FORMAT,
        "version": VERSION,
        "rollout_id": rollout_id,
        "created": time.time(),
        "records": json.dumps({"samples": samples, **records}, default=repr),
        "tensors": tensors,
    }
    _save_whole(data, path)
    return path


def _save_whole(data: dict, path: Path) -> None:
    """``torch.save`` of a dump's data to ``path``, whole or not at all (a temporary file renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(data, tmp)
    os.replace(tmp, path)


def add_train_log_probs(path: Path, log_probs: dict[int, list[float]]) -> None:
    """The trainer's log-probs of the dump's training sequences (by their place in ``train.samples``)
    into the dump at ``path``, rewritten whole as ``save_dump`` writes it."""
    path = Path(path)
    data = torch.load(path, weights_only=True)
    records = json.loads(data["records"])
    for i, values in log_probs.items():
        records["train"]["samples"][i]["train_log_probs"] = [float(v) for v in values]
    data["records"] = json.dumps(records, default=repr)
    _save_whole(data, path)


def load_dump(path: Path) -> dict:
    """A dump's plain data (DumpError naming the file when it is missing or not a dump)."""
    path = Path(path)
    if not path.is_file():
        raise DumpError(f"{path}: no rollout dump there")
    try:
        data = torch.load(path, weights_only=True)
    except Exception as e:
        raise DumpError(f"{path}: not a rollout dump ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        kind = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise DumpError(f"{path}: not a slime_mt rollout dump (format {kind})")
    if data.get("version") != VERSION:
        raise DumpError(f"{path}: rollout dump version {data['version']}; this slime_mt reads version {VERSION}")
    records = json.loads(data["records"])
    for where, value in data["tensors"].items():
        part, i, field, *key = where.split("/")
        target = records[part] if part == "samples" else records[part]["samples"]
        if key:
            target[int(i)][field][key[0]] = value
        else:
            target[int(i)][field] = value
    header = {k: v for k, v in data.items() if k not in ("records", "tensors")}
    return {**header, **records}


def samples_of(data: dict) -> list:
    """The dump's trajectories as Samples (images not reloaded: ``metadata['dump_images']`` names them)."""
    from slime_mt.types import Sample, Status, Turn

    out = []
    for record in data["samples"]:
        kw = {k: v for k, v in record.items() if k not in ("prompt_length", "images", "turns", "status")}
        sample = Sample(**kw, status=Status(record["status"]), turns=[Turn(**t) for t in record["turns"]])
        sample.metadata = {**sample.metadata, "dump_images": list(record["images"])}
        out.append(sample)
    return out


def train_batch_of(data: dict):
    """The TrainBatch the dump's step trained on."""
    from slime_mt.types import Status, TrainBatch, TrainingSample

    train = data["train"]
    samples = []
    for record in train["samples"]:
        kw = {k: v for k, v in record.items() if k not in ("advantage", "status", "train_log_probs")}
        samples.append(TrainingSample(**kw, status=Status(record["status"])))
    return TrainBatch(
        samples,
        list(train["advantages"]),
        dict(train["merge_metrics"]),
        dict(train["rollout_metrics"]),
        train["rollout_seconds"],
        train["rollout_started"],
        dict(train["metrics"]),
        list(train["trained_groups"]),
        train["note"],
    )
