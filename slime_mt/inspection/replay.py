"""``--load-debug-rollout-data`` (``--debug-train-only``): a step's dump, checked against the run that
replays it (``roles/replay.py`` is the rollout role of such a run)."""

from __future__ import annotations

from slime_mt.config.checkpoint import dump_path
from slime_mt.errors import DumpError
from slime_mt.inspection.dumps import load_dump, settings_of


def checked_dump(cfg, step: int) -> dict:
    """Step ``step``'s dump, checked against the run: its step, and the settings its sequences and
    advantages were made with (DumpError naming the file and the settings that differ)."""
    path = dump_path(cfg.debug.load_debug_rollout_data, step)
    data = load_dump(path)
    if data["rollout_id"] != step:
        raise DumpError(f"{path}: holds rollout {data['rollout_id']}, not step {step}")
    now = settings_of(cfg)
    changed = [f"{k}={v!r} (now {now.get(k)!r})" for k, v in data["settings"].items() if now.get(k) != v]
    if changed:
        raise DumpError(
            f"{path}: written with other settings: {', '.join(changed)}; replay with the flags of the run "
            "that wrote it (its config.yaml)"
        )
    return data
