"""Evaluation (``EvalConfig``): the held-out datasets, read as slime reads them (``--eval-config`` YAML with
``eval.defaults`` and ``eval.datasets``, or ``--eval-prompt-data NAME PATH ...``), their per-dataset
overrides, the cadence and the baseline before training; ``eval_datasets`` resolves them into
``EvalDataset``s, which ``roles/evaluation.py`` runs.

A dataset's setting comes from its entry, else ``eval.defaults``, else the eval flag (``--eval-top-p``),
else the training run's (``--rollout-top-p``), as slime's ``build_eval_dataset_configs`` resolves it."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from slime_mt.config.fields import group, option, positive, read_yaml, require
from slime_mt.config.rollout import check_rm_type
from slime_mt.errors import ConfigError, RewardError


@group("evaluation")
@dataclass
class EvalConfig:
    """Held-out datasets, their sampling and rewards, and when they are evaluated."""

    eval_interval: int | None = option(None, "Evaluate every N steps (and before the first: --skip-eval-before-train).")
    eval_prompt_data: list[str] | None = option(
        None,
        "Held-out datasets as NAME PATH pairs (slime's form; metrics eval/NAME/...); one PATH alone is named "
        "after its file.",
        nargs="+",
    )
    eval_config: str | None = option(
        None,
        "slime's evaluation YAML: eval.defaults and eval.datasets (name, path, rm_type, "
        "n_samples_per_eval_prompt, temperature, top_p, top_k, max_response_len, ...); wins over "
        "--eval-prompt-data.",
    )
    skip_eval_before_train: bool = option(False, "Do not evaluate the starting weights before the first step.")
    eval_function_path: str | None = option(
        None,
        "Eval rollout function fn(args, rollout_id, data_source, evaluation=True), called once per dataset "
        "(args.rollout_context holds that dataset's settings); unset: the built-in group rollout.",
    )
    n_samples_per_eval_prompt: int = option(1, "Trajectories per held-out prompt at each evaluation.")
    eval_temperature: float | None = option(
        None, "Sampling temperature at evaluation (0: greedy); unset: --rollout-temperature."
    )
    eval_top_p: float | None = option(None, "Nucleus sampling at evaluation; unset: --rollout-top-p.")
    eval_top_k: int | None = option(None, "Top-k at evaluation; unset: --rollout-top-k.")
    eval_max_response_len: int | None = option(None, "New tokens per turn at evaluation; unset: the rollout's.")
    eval_input_key: str | None = option(None, "Row key of the held-out prompt; unset: --input-key.")
    eval_label_key: str | None = option(None, "Row key of the held-out answer; unset: --label-key.")
    eval_tool_key: str | None = option(None, "Row key of the held-out tool schemas; unset: --tool-key.")


@dataclass(frozen=True)
class EvalDataset:
    """One held-out dataset with every setting resolved."""

    name: str
    path: str
    n_samples_per_eval_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int
    stop: list[str] | None
    stop_token_ids: list[int] | None
    rm_type: str | None  # put in each row's metadata["rm_type"], as slime does: the built-in grader's name
    custom_rm_path: str | None  # where one applies (the dataset's, else --custom-rm-path), it grades instead
    custom_generate_function_path: str
    rollout_interaction_env_path: str | None
    max_turns: int
    input_key: str
    label_key: str | None
    tool_key: str | None
    metadata_key: str
    multimodal_keys: dict | None
    apply_chat_template: bool

    def rollout_config(self, base):
        """The training run's ``RolloutConfig`` with this dataset's sampling, reward, generate function,
        environment and turns (one prompt group per row, no group filter)."""
        return dataclasses.replace(
            base,
            n_samples_per_prompt=self.n_samples_per_eval_prompt,
            rollout_temperature=self.temperature,
            rollout_top_p=self.top_p,
            rollout_top_k=self.top_k,
            rollout_max_response_len=self.max_response_len,
            rollout_stop=self.stop,
            rollout_stop_token_ids=self.stop_token_ids,
            rm_type=self.rm_type or base.rm_type,  # the grader runs (it reads the row's metadata first)
            custom_rm_path=self.custom_rm_path,
            custom_generate_function_path=self.custom_generate_function_path,
            rollout_interaction_env_path=self.rollout_interaction_env_path,
            max_turns=self.max_turns,
            dynamic_sampling_filter_path=None,
        )

    def data_config(self, base):
        """The training run's ``DataConfig`` with this dataset's row keys (rows in file order)."""
        return dataclasses.replace(
            base,
            input_key=self.input_key,
            label_key=self.label_key,
            tool_key=self.tool_key,
            metadata_key=self.metadata_key,
            multimodal_keys=self.multimodal_keys,
            apply_chat_template=self.apply_chat_template,
            rollout_shuffle=False,
        )


# a dataset entry's key -> (the eval flag, the training flag) it falls back to, in that order
FALLBACKS: dict[str, tuple[tuple[str, str], ...]] = {
    "n_samples_per_eval_prompt": (("evaluation", "n_samples_per_eval_prompt"),),
    "temperature": (("evaluation", "eval_temperature"), ("rollout", "rollout_temperature")),
    "top_p": (("evaluation", "eval_top_p"), ("rollout", "rollout_top_p")),
    "top_k": (("evaluation", "eval_top_k"), ("rollout", "rollout_top_k")),
    "max_response_len": (("evaluation", "eval_max_response_len"), ("rollout", "rollout_max_response_len")),
    "stop": (("rollout", "rollout_stop"),),
    "stop_token_ids": (("rollout", "rollout_stop_token_ids"),),
    "rm_type": (),
    "custom_rm_path": (("rollout", "custom_rm_path"),),
    "custom_generate_function_path": (("rollout", "custom_generate_function_path"),),
    "rollout_interaction_env_path": (("rollout", "rollout_interaction_env_path"),),
    "max_turns": (("rollout", "max_turns"),),
    "input_key": (("evaluation", "eval_input_key"), ("data", "input_key")),
    "label_key": (("evaluation", "eval_label_key"), ("data", "label_key")),
    "tool_key": (("evaluation", "eval_tool_key"), ("data", "tool_key")),
    "metadata_key": (("data", "metadata_key"),),
    "multimodal_keys": (("data", "multimodal_keys"),),
    "apply_chat_template": (("data", "apply_chat_template"),),
}
# slime's dataset keys this project does not act on: refused by name rather than ignored
NOT_HERE = (
    "apply_chat_template_kwargs",
    "min_new_tokens",
    "repetition_penalty",
    "skip_special_tokens",
    "no_stop_trim",
    "app_service",
    "eval_task_timeout",
    "min_eval_samples",
    "eval_early_stop_remaining",
    "eval_early_stop_idle_timeout",
    "message_processor",
    "reward_model",
    "remote_environment",
    "metadata_overrides",
)


def eval_datasets(cfg) -> list[EvalDataset]:
    """The run's held-out datasets, resolved (none without ``--eval-config`` or ``--eval-prompt-data``);
    ConfigError naming the file, the dataset and the key for what cannot be used."""
    e = cfg.evaluation
    defaults: dict[str, Any] = {}
    if e.eval_config:
        where = f"--eval-config {e.eval_config}"
        entries, defaults = _read_eval_config(e.eval_config)
    elif e.eval_prompt_data:
        where = "--eval-prompt-data"
        values = list(e.eval_prompt_data)
        if len(values) == 1:
            values = [os.path.splitext(os.path.basename(values[0]))[0], values[0]]
        if len(values) % 2:
            raise ConfigError(f"--eval-prompt-data {' '.join(values)}: give NAME PATH pairs (or one PATH)")
        entries = [{"name": values[i], "path": values[i + 1]} for i in range(0, len(values), 2)]
    else:
        return []
    for key in defaults:
        _check_key(key, f"{where}: eval.defaults")
    datasets = []
    for entry in entries:
        datasets.append(_resolve(cfg, entry, defaults, where))
    names = [d.name for d in datasets]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"{where}: dataset names must be unique; {', '.join(duplicates)} given more than once")
    return datasets


def eval_beside_rollout(cfg) -> bool:
    """``--async`` and ``--fully-async`` evaluate beside the rollout (``roles/rollout.py``): an evaluation
    runs on the engines while the next step generates and trains, and the next weight update waits for
    it, so it sees the weights it evaluates and no others. Sync runs evaluate between steps."""
    e, r = cfg.evaluation, cfg.rollout
    return bool(e.eval_interval and (e.eval_config or e.eval_prompt_data) and (r.async_mode or r.fully_async))


def priority_scheduling(cfg) -> bool:
    """Requests carry priorities: under ``--oldest-groups-first``, and where an evaluation runs beside
    the rollout (its requests last). Engines the run launches are started to schedule by them; an
    ``--engine-url`` SGLang server started without ``--enable-priority-scheduling`` ignores them (the
    embedded engine always schedules by them), and an ``--engine-url`` vLLM server started without
    ``--scheduling-policy priority`` would refuse them, so its evaluation asks as the rollout does."""
    if cfg.rollout.oldest_groups_first:
        return True
    return eval_beside_rollout(cfg) and not (cfg.engine.engine_url and cfg.engine.engine == "vllm")


def _read_eval_config(path: str) -> tuple[list[dict], dict]:
    """slime's layout: a mapping with ``eval`` (or the eval mapping itself) holding ``defaults`` and
    ``datasets`` (a list of entries with a ``name``, or a mapping from name to entry)."""
    where = f"--eval-config {path}"
    data = read_yaml(path, where, f"{where}: no such file")
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must hold a mapping at the top (eval: {{defaults: ..., datasets: [...]}})")
    section = data.get("eval", data)
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: eval must be a mapping of defaults and datasets")
    defaults = section.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{where}: eval.defaults must be a mapping")
    raw = section.get("datasets")
    if isinstance(raw, dict):
        entries = [{**(value or {}), "name": value.get("name", name) if value else name} for name, value in raw.items()]
    elif isinstance(raw, list):
        entries = []
        for i, value in enumerate(raw):
            if not isinstance(value, dict) or "name" not in value:
                raise ConfigError(f"{where}: eval.datasets[{i}] must be a mapping with a name")
            entries.append(dict(value))
    else:
        raise ConfigError(f"{where}: defines no datasets under eval.datasets")
    if not entries:
        raise ConfigError(f"{where}: defines no datasets under eval.datasets")
    return entries, defaults


def _check_key(key: str, where: str) -> None:
    if key in NOT_HERE:
        raise ConfigError(f"{where}: {key} is slime's and not supported here; drop it")
    if key not in FALLBACKS and key not in ("name", "path"):
        known = ", ".join(["name", "path", *FALLBACKS])
        raise ConfigError(f"{where}: unknown key {key!r}; the keys are {known}")


def _resolve(cfg, entry: dict, defaults: dict, where: str) -> EvalDataset:
    name = str(entry.get("name") or "")
    here = f"{where}: dataset {name!r}"
    require(bool(name) and "/" not in name, "eval_prompt_data", name or None, "a dataset needs a name without '/'")
    for key in entry:
        _check_key(key, here)
    path = entry.get("path")
    if not path:
        raise ConfigError(f"{here}: has no path")
    values = {}
    for key, fallbacks in FALLBACKS.items():
        if key in entry:
            values[key] = entry[key]
        elif key in defaults:
            values[key] = defaults[key]
        else:
            values[key] = next(
                (v for g, k in fallbacks if (v := getattr(getattr(cfg, g), k)) is not None),
                None,
            )
    if values["rm_type"] and not values["custom_rm_path"]:  # a reward function, where one applies, grades
        try:
            check_rm_type(str(values["rm_type"]), f"{here}: rm_type")
        except RewardError as err:
            raise ConfigError(str(err)) from None
    dataset = EvalDataset(name=name, path=str(path), **values)
    _check_values(dataset, here)
    return dataset


def _check_values(d: EvalDataset, here: str) -> None:
    for key in ("n_samples_per_eval_prompt", "max_response_len", "max_turns"):
        value = getattr(d, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{here}: {key} {value!r} must be a positive integer")
    if not isinstance(d.temperature, (int, float)) or d.temperature < 0:
        raise ConfigError(f"{here}: temperature {d.temperature!r} must be >= 0 (0: greedy)")
    if not isinstance(d.top_p, (int, float)) or not 0 < d.top_p <= 1:
        raise ConfigError(f"{here}: top_p {d.top_p!r} must be in (0, 1]")
    if not isinstance(d.top_k, int) or not (d.top_k == -1 or d.top_k > 0):
        raise ConfigError(f"{here}: top_k {d.top_k!r} must be -1 (off) or positive")


def validate_eval(cfg) -> None:
    """The cadence, the datasets (read and resolved: every path, key and value) and what they need."""
    e = cfg.evaluation
    positive(e, ("eval_interval",), optional=True)
    positive(e, ("n_samples_per_eval_prompt",))
    positive(e, ("eval_max_response_len",), optional=True)
    require(
        e.eval_temperature is None or e.eval_temperature >= 0,
        "eval_temperature",
        e.eval_temperature,
        "must be >= 0 (0: greedy)",
    )
    require(e.eval_top_p is None or 0 < e.eval_top_p <= 1, "eval_top_p", e.eval_top_p, "must be in (0, 1]")
    require(e.eval_top_k in (None, -1) or e.eval_top_k > 0, "eval_top_k", e.eval_top_k, "must be -1 (off) or positive")
    datasets = eval_datasets(cfg)
    r = cfg.rollout
    for d in datasets:
        overrides = d.rollout_interaction_env_path != r.rollout_interaction_env_path
        overrides = overrides or d.custom_generate_function_path != r.custom_generate_function_path
        overrides = overrides or d.custom_rm_path != r.custom_rm_path
        require(
            not (overrides and (r.env_num_workers or r.rollout_num_processes > 1)),
            "eval_config",
            e.eval_config or e.eval_prompt_data,
            f"dataset {d.name!r} has an environment, generate function or reward function of its own; "
            "environment workers and rollout processes run the training run's (use --env-num-workers 0 and "
            "--rollout-num-processes 1, or the training run's plug-ins)",
        )
