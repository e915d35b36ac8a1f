"""Typed configuration: one dataclass per concern (an option group), each in its module with its rules.

  rollout.py      DataConfig, RolloutConfig      prompts, the turn loop, sampling, groups, async modes, reward
  engine.py       EngineConfig                   the engines, weight transport, FP8 rollout
  cluster.py      ClusterConfig                  Ray placement, colocation, offload
  algo.py         AlgoConfig                     advantages, the loss, KL, entropy, off-policy correction
  training.py     TrainConfig                    the Megatron model: parallelism, batches, optimizer
  checkpoint.py   CheckpointConfig, DebugConfig  checkpoints, cadences, sinks; dumps, turn records, trace
  evaluation.py   EvalConfig                     held-out datasets (slime's eval YAML), their overrides, cadence
  agents.py       GatewayConfig, JudgeConfig     the agent gateway; the LLM judge and the code sandbox

Every field of every group is a CLI flag (``eps_clip`` -> ``--eps-clip``, names follow slime's) and a YAML
key (``eps_clip`` or ``eps-clip``); ``config_parsing.py`` reads them from argv and YAML files. ``validate``
rejects impossible values naming the flag, each group's rules in its module (``validate_<group>``). The
package imports nothing of the project but ``slime_mt.errors``: every other module may read it.

Library code receives one concern (``cfg.rollout``); user plug-ins receive ``cfg.to_args()``, a flat
slime-style namespace that also carries the custom keys.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from slime_mt.config.agents import AGENT_GENERATE, GatewayConfig, JudgeConfig, validate_gateway, validate_judge
from slime_mt.config.algo import AlgoConfig, validate_algo
from slime_mt.config.checkpoint import CheckpointConfig, DebugConfig, validate_checkpoint, validate_debug
from slime_mt.config.cluster import ClusterConfig, validate_cluster
from slime_mt.config.engine import EngineConfig, engine_args, extra_arg, validate_engine
from slime_mt.config.evaluation import (
    EvalConfig,
    EvalDataset,
    eval_beside_rollout,
    eval_datasets,
    priority_scheduling,
    validate_eval,
)
from slime_mt.config.fields import GROUP_CLASSES, REGISTERED, flag_name
from slime_mt.config.rollout import DataConfig, RolloutConfig, validate_rollout
from slime_mt.config.training import TrainConfig, validate_training

__all__ = [
    "AGENT_GENERATE",
    "ALIASES",
    "FIELDS",
    "GROUPS",
    "AlgoConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "DataConfig",
    "DebugConfig",
    "EngineConfig",
    "EvalConfig",
    "EvalDataset",
    "GatewayConfig",
    "JudgeConfig",
    "RolloutConfig",
    "TrainConfig",
    "engine_args",
    "eval_beside_rollout",
    "eval_datasets",
    "extra_arg",
    "flag_name",
    "priority_scheduling",
    "validate",
]

# the groups in the order of the help text, the YAML a run writes and the flat namespace
GROUPS: dict[str, type] = {
    name: GROUP_CLASSES[name]
    for name in (
        "data",
        "rollout",
        "engine",
        "cluster",
        "algo",
        "train",
        "checkpoint",
        "evaluation",
        "gateway",
        "judge",
        "debug",
    )
}


@dataclass
class Config:
    """The whole run: one typed object per concern plus the user's custom YAML keys."""

    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    custom: dict[str, Any] = field(default_factory=dict)

    def to_args(self) -> argparse.Namespace:
        """A flat slime-style namespace (every field plus custom keys) for user plug-ins."""
        flat: dict[str, Any] = dict(self.custom)
        for group in GROUPS:
            flat.update(dataclasses.asdict(getattr(self, group)))
        return argparse.Namespace(**flat)

    def to_yaml(self) -> str:
        """The resolved settings, one section per concern (and ``custom``); ``--config`` reads it back."""
        data: dict[str, Any] = {group: dataclasses.asdict(getattr(self, group)) for group in GROUPS}
        if self.custom:
            data["custom"] = self.custom
        return yaml.safe_dump(data, sort_keys=False)


# every field of every group: name -> (group, Field), in GROUPS' order; names are unique across groups
FIELDS: dict[str, tuple[str, dataclasses.Field]] = {
    f.name: REGISTERED[f.name] for cls in GROUPS.values() for f in dataclasses.fields(cls)
}


def _aliases(f) -> list[str]:
    """A field's other YAML keys: its ``aliases`` and slime's flag name for it (as a key)."""
    slimes = [f.metadata["slime_flag"].removeprefix("--").replace("-", "_")] if "slime_flag" in f.metadata else []
    return [*f.metadata.get("aliases", []), *slimes]


ALIASES = {alias: name for name, (_, f) in FIELDS.items() for alias in _aliases(f)}


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the flag and value of the first impossible setting or combination, group
    by group."""
    validate_rollout(cfg)
    validate_engine(cfg)
    validate_cluster(cfg)
    validate_gateway(cfg)
    validate_judge(cfg)
    validate_checkpoint(cfg)
    validate_eval(cfg)
    validate_debug(cfg)
    validate_training(cfg)
    validate_algo(cfg)
