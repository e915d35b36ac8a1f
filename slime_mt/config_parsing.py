"""The configuration's front end: CLI flags, YAML files, value coercion, "did you mean".

The ``slime_mt.config`` package holds the schema (one dataclass per concern, the index of their fields,
and each group's rules); this module turns argv and YAML files into a validated ``Config``. Precedence:
dataclass default < ``--config`` YAML < ``--custom-config-path`` YAML < CLI. An unknown CLI flag is an
error; an unknown YAML key is kept in ``Config.custom`` (slime users pass env knobs this way), logged,
and warned about with "did you mean" when it is close to a known key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import shlex
import types
import typing
from typing import Any

from slime_mt.config import ALIASES, FIELDS, GROUPS, Config, flag_name, validate
from slime_mt.config.fields import read_yaml
from slime_mt.config.slime_flags import refused
from slime_mt.errors import ConfigError

logger = logging.getLogger(__name__)


def _base_type(f: dataclasses.Field) -> tuple[type, bool]:
    """(scalar type, is_list) of a field annotated like ``int | None`` or ``list[str] | None``."""
    hint = typing.get_type_hints(GROUPS[FIELDS[f.name][0]])[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    inner = args[0]
    if typing.get_origin(inner) is list:
        return typing.get_args(inner)[0], True
    return inner, False


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _coerce(key: str, value: Any, source: str) -> Any:
    """Check and convert a YAML value to the field's type; errors name the key and the source."""
    f = FIELDS[key][1]
    scalar, is_list = _base_type(f)
    if value is None:
        return None
    if f.metadata.get("json"):
        if isinstance(value, str):
            return _parse_json(value, key)
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}' must be a mapping, got {value!r}")
        return value
    if is_list:
        items = value if isinstance(value, list) else [value]
        return [_coerce_scalar(key, scalar, v, source) for v in items]
    return _coerce_scalar(key, scalar, value, source)


def _coerce_scalar(key: str, scalar: type, value: Any, source: str) -> Any:
    if scalar is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif scalar is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif scalar is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads 1e-6 without a dot as a string
        except ValueError:
            pass
    elif scalar is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif scalar is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{source}: key '{key}' expects {scalar.__name__}, got {value!r}")


def _parse_json(text: str, key: str) -> dict:
    try:
        return _json_object(text)
    except ValueError as e:
        raise ConfigError(f"{flag_name(key)}: {e}") from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def _json_arg(text: str) -> dict:
    """argparse type for JSON flags; ArgumentTypeError makes argparse print our message."""
    try:
        return _json_object(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---------------------------------------------------------------- argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every config field as a flag, one argument group per concern; defaults are SUPPRESSed
    so that the parsed namespace holds only what the user typed (needed for CLI > YAML)."""
    parser.add_argument(
        "--config",
        action="append",
        default=argparse.SUPPRESS,
        metavar="YAML",
        help="YAML file of settings (repeatable; later files win; CLI beats YAML).",
    )
    for group, cls in GROUPS.items():
        arg_group = parser.add_argument_group(group, (cls.__doc__ or "").strip())
        for f in dataclasses.fields(cls):
            scalar, is_list = _base_type(f)
            kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
            default = None if f.default is dataclasses.MISSING else f.default
            kw["help"] = f"{f.metadata['help']} (default: {default})"
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            if f.metadata.get("json"):
                kw["type"] = _json_arg
                kw["metavar"] = "JSON"
            elif scalar is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = scalar
                if is_list:
                    kw["nargs"] = f.metadata.get("nargs", "+")
            slimes = [f.metadata["slime_flag"]] if "slime_flag" in f.metadata else []  # slime's name for it
            arg_group.add_argument(flag_name(f.name), *slimes, **kw)
    parser.add_argument(
        "--custom-config-path",
        dest="custom_config_path",
        default=argparse.SUPPRESS,
        metavar="YAML",
        help="slime's name for a YAML of settings; applied after --config.",
    )


class _StrictParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so callers and tests see the message."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise ConfigError(f"{self.prog}: {message}")

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        extras = pass_sglang_args(ns, extras)
        if extras:
            self.error(unrecognized(extras, option_strings(self)))
        return ns


def pass_sglang_args(ns: argparse.Namespace, extras: list[str]) -> list[str]:
    """slime's ``--sglang-<arg> [VALUE ...]`` flags (slime takes every SGLang server argument so): each is
    SGLang's ``--<arg>``, appended to ``ns.sglang_extra_args`` for every SGLang server the run launches
    (SGLang itself refuses one it does not know). Returns the extras that are not such flags."""
    sglang: list[str] = []
    rest: list[str] = []
    taking = False
    for token in extras:
        if token.startswith("--sglang-"):
            sglang.append("--" + token.removeprefix("--sglang-"))
            taking = "=" not in token
        elif taking and not token.startswith("--"):
            sglang.append(token)
        else:
            taking = False
            rest.append(token)
    if sglang:
        ns.sglang_extra_args = " ".join(filter(None, [getattr(ns, "sglang_extra_args", None), shlex.join(sglang)]))
    return rest


def build_parser(prog: str = "slime-mt train") -> argparse.ArgumentParser:
    parser = _StrictParser(
        prog=prog,
        description="Multi-turn RL training flags (slime names).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_arguments(parser)
    return parser


def parse_config(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> Config:
    """Parse CLI flags and the YAML files they name into a validated Config."""
    parser = parser or build_parser()
    ns = parser.parse_args(argv)
    return config_from_namespace(ns)


def config_from_namespace(ns: argparse.Namespace) -> Config:
    """Merge: defaults < each --config YAML < --custom-config-path YAML < explicit CLI values."""
    given = vars(ns)
    values: dict[str, Any] = {}
    custom: dict[str, Any] = {}
    yaml_paths = list(given.get("config", [])) + (
        [given["custom_config_path"]] if "custom_config_path" in given else []
    )
    for path in yaml_paths:
        known, unknown = load_yaml(path)
        values.update(known)
        custom.update(unknown)
    for key, value in given.items():
        if key in FIELDS:
            values[key] = value
    return build_config(values, custom)


def build_config(values: dict[str, Any], custom: dict[str, Any] | None = None) -> Config:
    """A validated Config from flat ``field -> value`` settings (already coerced)."""
    per_group: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
    for key, value in values.items():
        if key not in FIELDS:
            raise ConfigError(f"unknown setting '{key}'{_did_you_mean(key)}")
        per_group[FIELDS[key][0]][key] = value
    cfg = Config(**{g: GROUPS[g](**kv) for g, kv in per_group.items()}, custom=dict(custom or {}))
    validate(cfg)
    return cfg


def load_yaml(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a YAML settings file -> (known settings coerced to their types, custom keys)."""
    data = read_yaml(path, path, f"config file not found: {path}")
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of settings, got {type(data).__name__}")
    known: dict[str, Any] = {}
    custom: dict[str, Any] = {}
    flat: dict[Any, Any] = {}
    for raw_key, value in data.items():  # sections as Config.to_yaml writes them, or flat keys
        if (raw_key in GROUPS or raw_key == "custom") and isinstance(value, dict):
            flat.update(value)
        else:
            flat[raw_key] = value
    for raw_key, value in flat.items():
        key = str(raw_key).replace("-", "_")
        key = ALIASES.get(key, key)
        if key in FIELDS:
            known[key] = _coerce(key, value, path)
        else:
            custom[key] = value
            hint = _did_you_mean(key)
            if hint:
                logger.warning("%s: unknown key '%s' kept as a custom setting%s", path, raw_key, hint)
            else:
                logger.info("%s: custom setting %s=%r", path, raw_key, value)
    return known, custom


def _did_you_mean(key: str) -> str:
    """', did you mean --x?' when key is within a small edit distance of a known field."""
    best = closest(key, FIELDS)
    return f", did you mean {flag_name(best)}?" if best else ""


def closest(word: str, candidates) -> str | None:
    """The candidate within a small edit distance of ``word`` (None when none is close)."""
    best = min(candidates, key=lambda name: _edit_distance(word, name))
    distance = _edit_distance(word, best)
    if distance <= max(2, len(word) // 6) or difflib.SequenceMatcher(None, word, best).ratio() >= 0.9:
        return best
    return None


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--flag`` a parser accepts (argparse keeps them on its actions)."""
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def unrecognized(extras: list[str], options) -> str:
    """argparse's 'unrecognized arguments' message, with 'did you mean' for each misspelled flag."""
    hints = []
    for arg in extras:
        flag = arg.split("=", 1)[0]
        slimes = refused(flag) if flag.startswith("--") else None
        best = closest(flag, options) if flag.startswith("--") and not slimes else None
        if slimes:
            hints.append(slimes)
        elif best:
            hints.append(f"{flag}: did you mean {best}?")
    return "unrecognized arguments: " + " ".join(extras) + (" (" + "; ".join(hints) + ")" if hints else "")


def _edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]
