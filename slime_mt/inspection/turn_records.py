"""``RUN_DIR/turns.jsonl``: one line per LLM turn of every step's trajectories (``--turn-records``).

A line: step, sample (index), group, turn (its index in the trajectory), context_tokens (what the model
saw: the rewritten context's length where the context policy rewrote it, else every token before the
turn's output), generated_tokens, observation_tokens, finish_reason, engine_seconds, env_seconds,
retries (env step retries), invalid_action, reward (the env's per-turn reward, when it gave one),
weight_version, context_rewritten, and the trajectory's status and termination.

``--turn-records all`` (the default) writes every turn, ``off`` none, ``N`` the turns of at most N
samples a step: whole groups, picked at random (seeded by ``--rollout-seed`` and the step).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from slime_mt.config.checkpoint import parse_turn_records

TURNS_FILE = "turns.jsonl"


def turn_lines(step: int, sample) -> list[dict]:
    """The lines of one trajectory's turns."""
    lines = []
    for k, turn in enumerate(sample.turns):
        rewritten = turn.context_ids is not None
        lines.append(
            {
                "step": step,
                "sample": sample.index,
                "group": sample.group_index,
                "turn": k,
                "context_tokens": len(turn.context_ids) if rewritten else turn.output_start,
                "generated_tokens": turn.output_end - turn.output_start,
                "observation_tokens": turn.observation_end - turn.output_end,
                "finish_reason": turn.finish_reason,
                "engine_seconds": round(turn.engine_seconds, 6),
                "env_seconds": round(turn.env_seconds, 6),
                "retries": turn.env_retries,
                "invalid_action": bool(turn.env_info.get("invalid_action", False)),
                "reward": turn.reward,
                "weight_version": turn.weight_version,
                "context_rewritten": rewritten,
                "status": getattr(sample.status, "value", sample.status),
                "termination": sample.metadata.get("termination"),
            }
        )
    return lines


def chosen_groups(groups: list[list], limit: int | None, seed: int, step: int) -> list[list]:
    """The groups whose turns are recorded: all, or whole groups at random up to ``limit`` samples."""
    if limit is None:
        return groups
    order = list(range(len(groups)))
    random.Random(f"{seed}/{step}").shuffle(order)
    chosen, count = [], 0
    for i in order:
        if count + len(groups[i]) > limit and chosen:
            break
        chosen.append(i)
        count += len(groups[i])
    return [groups[i] for i in sorted(chosen)]


class TurnRecords:
    """Appends each step's lines to ``RUN_DIR/turns.jsonl``."""

    def __init__(self, run_dir: Path, setting: str, seed: int) -> None:
        self.path = Path(run_dir) / TURNS_FILE
        self.limit = parse_turn_records(setting)
        self.seed = seed

    def write(self, step: int, groups: list[list]) -> None:
        if self.limit == 0:
            return
        lines = [
            json.dumps(line)
            for group in chosen_groups(groups, self.limit, self.seed, step)
            for sample in group
            for line in turn_lines(step, sample)
        ]
        if lines:
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")

    def truncate_after(self, step: int) -> None:
        """A resumed run at ``step``: the lines of the steps it runs again go."""
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] < step]
        self.path.write_text("".join(line + "\n" for line in kept))
