"""What every option group is made of: a field (``option``: its default, help text and argparse extras),
the registration of a group's dataclass (``group``), a field's flag name, and the rule helper every
group's validation raises through (``require``: a ConfigError naming the flag and its value), and the
reader of a YAML settings file (``read_yaml``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from typing import Any

import yaml

from slime_mt.errors import ConfigError

# every registered group's fields: name -> (group, Field); names are unique across groups
REGISTERED: dict[str, tuple[str, dataclasses.Field]] = {}
GROUP_CLASSES: dict[str, type] = {}


def option(default: Any, help: str, **meta: Any) -> Any:
    """A config field: its default, its help text and argparse extras (``choices``, ``metavar``, ``nargs``;
    ``flag``: a flag name other than the field's; ``slime_flag``: slime's flag for it, also taken;
    ``aliases``: other YAML keys; ``json``: a JSON value)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def read_yaml(path: str, where: str, missing: str) -> Any:
    """A YAML file's contents (None when it is empty); a missing file raises ``missing``, bad YAML a
    ConfigError naming ``where``."""
    if not os.path.isfile(path):
        raise ConfigError(missing)
    with open(path) as fh:
        try:
            return yaml.safe_load(fh)
        except yaml.YAMLError as err:
            raise ConfigError(f"{where}: not valid YAML: {err}") from None


def group(name: str):
    """Register a dataclass as the option group ``name`` (the attribute of ``Config`` that holds it)."""

    def register(cls: type) -> type:
        for f in dataclasses.fields(cls):
            if f.name in REGISTERED:
                raise TypeError(f"config field {f.name} of {name} is already {REGISTERED[f.name][0]}'s")
            REGISTERED[f.name] = (name, f)
        GROUP_CLASSES[name] = cls
        return cls

    return register


def flag_name(key: str) -> str:
    """The CLI flag of field ``key``: ``--`` and its name with dashes, or the one its metadata gives."""
    if key in REGISTERED and "flag" in REGISTERED[key][1].metadata:
        return REGISTERED[key][1].metadata["flag"]
    return "--" + key.replace("_", "-")


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """Raise ``ConfigError("--flag=value: why")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{flag_name(key)}={value!r}: {why}")


def positive(group_config: Any, keys: tuple[str, ...], optional: bool = False) -> None:
    """Each of ``keys`` of one group a positive integer (``optional``: or None)."""
    for key in keys:
        value = getattr(group_config, key)
        require(
            (optional and value is None) or (value is not None and value > 0), key, value, "must be a positive integer"
        )
