"""``slime-mt inspect RUN_DIR``: the run as one self-contained HTML page (``viewer.html``: no network,
no server, opens from a file), or as a terminal summary (``--text``).

The page holds the run's curves (metrics.jsonl) and, for every dumped step (``--save-debug-rollout-data``;
the dump path comes from the run's config.yaml, or ``--dumps``), every group and trajectory: its turns
in order, every token classed as prompt, trained output, observation or masked (generated, not
trained: a failed sample, ``--mask-truncated``, stale-token masking), with its id, log-prob and
weight version, the images inline, the context the model saw at each turn and what the context policy
removed from it, rewards, advantages, and the training sequences each trajectory became (which turns a
step-wise merge joined). The page draws a trajectory's tokens only when it is opened, and its rows in
pages as they scroll into view, so a 10,000-trajectory step loads in seconds.
"""

from __future__ import annotations

import base64
import difflib
import glob
import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import yaml

from slime_mt.errors import InspectError
from slime_mt.inspection.dumps import load_dump
from slime_mt.metrics import read_evals, read_metrics
from slime_mt.processing import load_tokenizer_or_processor, tokenizer_of
from slime_mt.rollout.retokenize import common_ends

VIEWER = Path(__file__).with_name("viewer.html")
CURVES = {
    "reward": ["rollout/reward_mean", "rollout/pass_rate"],  # and each eval dataset's: eval_curves
    "turns": ["rollout/turns_mean", "rollout/turns_max"],
    "lengths": ["rollout/response_tokens_mean", "rollout/observation_tokens"],
    "staleness": ["rollout/weight_version_gap"],
    "timings": ["time/rollout_seconds", "time/train_seconds", "time/sync_seconds", "time/step_seconds"],
    "training": ["train/loss", "train/grad_norm"],
}
DIFF_LIMIT = 20_000  # tokens: longer contexts are compared by common prefix and suffix only


# ---------------------------------------------------------------- finding the run's files


def run_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def dump_files(run_dir: Path, template: str | None = None, evaluation: bool = False) -> dict[int, Path]:
    """step -> dump file, from ``template`` or the run's ``--save-debug-rollout-data``; with
    ``evaluation``, steps trained -> the dump of the evaluation after them (``eval_N``)."""
    template = template or (run_config(run_dir).get("debug") or {}).get("save_debug_rollout_data")
    if not template:
        return {}
    rollout_id = r"eval_(\d+)" if evaluation else r"(\d+)"
    pattern = re.compile(re.escape(template).replace(re.escape("{rollout_id}"), rollout_id) + "$")
    found = {}
    for name in glob.glob(template.replace("{rollout_id}", "*")):
        match = pattern.match(name)
        if match:
            found[int(match.group(1))] = Path(name)
    return dict(sorted(found.items()))


def read_metrics_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows; none for a run that logged no step yet."""
    try:
        return read_metrics(run_dir)
    except FileNotFoundError:
        return []


def selected(files: dict[int, Path], step: int | None, run_dir: Path) -> dict[int, Path]:
    """The dumps ``--step`` asks for (all without it); InspectError naming the dumped steps."""
    if step is None:
        return files
    if step not in files:
        have = ", ".join(map(str, files)) or "none"
        raise InspectError(f"--step {step}: no dump of that step in {run_dir} (dumped steps: {have})")
    return {step: files[step]}


# ---------------------------------------------------------------- what was trained


def _context_length(turn: dict) -> int:
    """Tokens the model saw at a turn."""
    return len(turn["context_ids"]) if turn["context_ids"] is not None else turn["output_start"]


def _positions(sample: dict, seq: dict) -> Iterator[tuple[int, int | None]]:
    """Where a training sequence holds a dumped trajectory's output tokens: (the token's index in the
    trajectory's response, its index in the sequence's response, None past the sequence's end)."""
    n, length, turns = sample["response_length"], len(seq["loss_mask"]), sample["turns"]
    if seq["turns"] is None:  # concat: the response itself
        yield from ((j, j) for j in range(min(n, length)))
        return
    start, first = sample["prompt_length"], _context_length(turns[seq["turns"][0]])
    cursor = 0
    for position, k in enumerate(seq["turns"]):
        turn = turns[k]
        for j in range(turn["output_end"] - turn["output_start"]):
            yield turn["output_start"] - start + j, cursor if cursor < length else None
            cursor += 1
        if position + 1 < len(seq["turns"]):  # a merge put the next step's context delta here
            cursor = _context_length(turns[seq["turns"][position + 1]]) - first


def trained_flags(sample: dict, sequences: list[dict]) -> list[int]:
    """Per response token of a dumped trajectory: 1 if a training sequence trained it (loss mask 1
    there), else 0. ``sequences``: the step's training records of this trajectory."""
    flags = [0] * sample["response_length"]
    for seq in sequences:
        for r, c in _positions(sample, seq):
            flags[r] = int(seq["loss_mask"][c]) if c is not None else 0
    return flags


def log_prob_gaps(sample: dict, sequences: list[dict]) -> list[float | None] | None:
    """Per response token of a dumped trajectory: the trainer's log-prob (the sequence's
    ``train_log_probs``) minus the engine's, to 4 decimals, where a sequence trained it and both are
    known; None when no sequence of it has the trainer's (a step that did not train, an older dump)."""
    rollout = sample["rollout_log_probs"]
    if rollout is None:
        return None
    gaps: list[float | None] = [None] * sample["response_length"]
    found = False
    for seq in sequences:
        values = seq.get("train_log_probs")
        if not values:
            continue
        for r, c in _positions(sample, seq):
            if c is not None and seq["loss_mask"][c] and math.isfinite(rollout[r]) and math.isfinite(values[c]):
                gaps[r], found = round(values[c] - rollout[r], 4), True
    return gaps if found else None


def token_classes(sample: dict, trained: list[int]) -> str:
    """One letter per token: p prompt, o trained output, b observation (loss mask 0), x masked
    (generated, loss mask 1 in the trajectory, not trained)."""
    response = "".join("b" if m == 0 else ("o" if t else "x") for m, t in zip(sample["loss_mask"], trained))
    return "p" * sample["prompt_length"] + response


def context_ops(history: list[int], context: list[int]) -> list[list]:
    """How a rewritten context differs from the full history: difflib opcodes [tag, i1, i2, j1, j2]."""
    if len(history) + len(context) > DIFF_LIMIT:
        prefix, suffix = common_ends(history, context)
        ops = [["equal", 0, prefix, 0, prefix]]
        ops.append(["replace", prefix, len(history) - suffix, prefix, len(context) - suffix])
        ops.append(["equal", len(history) - suffix, len(history), len(context) - suffix, len(context)])
        return [op for op in ops if op[2] > op[1] or op[4] > op[3]]
    matcher = difflib.SequenceMatcher(None, history, context, autojunk=False)
    return [list(op) for op in matcher.get_opcodes()]


def _image_uri(folder: Path, name: str) -> str | None:
    path = folder / name
    if not path.is_file():
        return None
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _round(values: list[float] | None) -> list[float | None] | None:
    """Log-probs to 4 decimals; a non-finite one becomes None (JSON has no NaN)."""
    return None if values is None else [round(v, 4) if math.isfinite(v) else None for v in map(float, values)]


def _finite(value):
    """``value`` with every non-finite float None, for the page's JSON (small values only)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def step_view(data: dict, folder: Path, ids_seen: set[int]) -> dict:
    """One dumped step in the page's compact form."""
    by_trajectory: dict[str, list[dict]] = {}
    for seq in data["train"]["samples"]:
        by_trajectory.setdefault(seq["trajectory_id"], []).append(seq)
    samples = []
    for s in data["samples"]:
        sequences = by_trajectory.get(f"{s['group_index']}/{s['index']}", [])
        trained = trained_flags(s, sequences)
        ids_seen.update(s["tokens"])
        turns = []
        for t in s["turns"]:
            view = {
                "os": t["output_start"],
                "oe": t["output_end"],
                "ob": t["observation_end"],
                "finish": t["finish_reason"],
                "version": t["weight_version"],
                "engine_s": round(t["engine_seconds"], 4),
                "env_s": round(t["env_seconds"], 4),
                "retries": t["env_retries"],
                "reward": _finite(t["reward"]),
                "info": _finite(t["env_info"]),
                "images": t["image_indices"] if t["image_indices"] is not None else list(range(t["num_images"])),
            }
            if t["context_ids"] is not None:
                ids_seen.update(t["context_ids"])
                view["ctx"] = t["context_ids"]
                view["ops"] = context_ops(s["tokens"][: t["output_start"]], t["context_ids"])
            turns.append(view)
        samples.append(
            {
                "index": s["index"],
                "group": s["group_index"],
                "status": s["status"],
                "reward": None if s["status"] == FAILED else _finite(s["reward"]),  # a FAILED sample has none
                "termination": s["metadata"].get("termination"),
                "error": s["metadata"].get("error"),
                "ids": s["tokens"],
                "cls": token_classes(s, trained),
                "lp": _round(s["rollout_log_probs"]),
                "gap": log_prob_gaps(s, sequences),
                "ver": s["token_versions"],
                "pl": s["prompt_length"],
                "turns": turns,
                "images": [_image_uri(folder, name) for name in s["images"]],
                "sequences": [
                    {
                        "turns": seq["turns"],
                        "advantage": _finite(round(seq["advantage"], 6)),
                        "reward": _finite(seq["reward"]),
                        "tokens": len(seq["prompt_ids"]) + len(seq["response_ids"]),
                        "trained": sum(seq["loss_mask"]),
                    }
                    for seq in sequences
                ],
            }
        )
    view = {"step": data["rollout_id"], "label": f"step {data['rollout_id']}", "samples": samples}
    view["note"] = data["train"]["note"]
    if "eval" in data:  # an evaluation's dump: each trajectory's dataset, in the order of the samples
        names = [name for name, count in data["eval"]["datasets"] for _ in range(count)]
        for sample, name in zip(samples, names, strict=True):
            sample["dataset"] = name
        view["label"] = f"eval after {data['eval']['after_steps']} steps"
        view["datasets"] = data["eval"]["datasets"]
    return view


def _pieces(tokenizer_path: str | None, ids: set[int]) -> dict[int, str]:
    """Each token id's text, decoded alone; empty when the run's tokenizer cannot be loaded."""
    if not tokenizer_path or not ids:
        return {}
    try:
        tokenizer = tokenizer_of(load_tokenizer_or_processor(tokenizer_path))
    except Exception:
        return {}
    return {i: tokenizer.decode([i]) for i in sorted(ids)}


def page_data(run_dir: Path, step: int | None = None, dumps: str | None = None) -> dict:
    """Everything the page shows, as plain data."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InspectError(f"{run_dir}: not a folder")
    rows = read_metrics_rows(run_dir)
    files = selected(dump_files(run_dir, dumps), step, run_dir)
    evals = dump_files(run_dir, dumps, evaluation=True) if step is None else {}  # --step: that step's alone
    files = [*files.values(), *evals.values()]
    ids: set[int] = set()
    steps = [step_view(load_dump(path), path.parent, ids) for path in files]
    config = run_config(run_dir)
    curves = {
        title: {key: [[r["step"], r[key]] for r in rows if isinstance(r.get(key), (int, float))] for key in keys}
        for title, keys in CURVES.items()
    }
    curves["reward"] |= eval_curves(read_evals(run_dir))
    return {
        "run": str(run_dir),
        "model": (config.get("train") or {}).get("hf_checkpoint"),
        "curves": {t: {k: v for k, v in c.items() if v} for t, c in _finite(curves).items()},
        "steps": steps,
        "pieces": _pieces((config.get("train") or {}).get("hf_checkpoint"), ids),
    }


def write_report(run_dir: Path, out: Path | None = None, step: int | None = None, dumps: str | None = None) -> Path:
    """The page for ``run_dir`` -> its path (default ``RUN_DIR/report.html``)."""
    data = page_data(Path(run_dir), step, dumps)
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    html = VIEWER.read_text().replace("__SLIME_MT_DATA__", payload)
    out = Path(out) if out else Path(run_dir) / "report.html"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(html)
    tmp.replace(out)
    return out


# ---------------------------------------------------------------- the terminal summary


FAILED = "failed"  # Status.FAILED as a dump spells it


def eval_curves(evals: list[dict]) -> dict[str, list[list[float]]]:
    """Each eval dataset's reward and pass@1 against the steps trained before it (0: the baseline)."""
    keys = sorted({k for e in evals for k in e if k.endswith(("/reward_mean", "/pass@1"))})
    return {k: [[e["step"], e[k]] for e in evals if isinstance(e.get(k), (int, float))] for k in keys}


def scored_rewards(samples: list[dict]) -> list[float]:
    """The rewards ``rollout/reward_mean`` averages: every sample but the FAILED ones (no reward: None
    counts 0), so the summary's mean is the metric's."""
    return [float(s["reward"] or 0.0) for s in samples if s["status"] != FAILED]


def text_summary(run_dir: Path, step: int | None = None, dumps: str | None = None) -> str:
    """The run in lines: its curves' last values, then per dumped step its samples (one line each
    with ``--step``)."""
    run_dir = Path(run_dir)
    rows = read_metrics_rows(run_dir)
    lines = [f"run {run_dir}: {len(rows)} steps logged"]
    if rows:
        last = rows[-1]
        shown = [k for keys in CURVES.values() for k in keys if isinstance(last.get(k), (int, float))]
        lines.append(f"step {last['step']}: " + ", ".join(f"{k.split('/', 1)[1]} {last[k]:.4g}" for k in shown))
    for key, points in eval_curves(read_evals(run_dir)).items():  # each eval dataset's curve
        lines.append(f"{key}: " + ", ".join(f"{v:.4g} after {int(s)} steps" for s, v in points))
    files = dump_files(run_dir, dumps)
    evals = dump_files(run_dir, dumps, evaluation=True)
    if not files and not evals:
        lines.append("no rollout dumps (run with --save-debug-rollout-data to see trajectories)")
        return "\n".join(lines)
    for k, path in selected(files, step, run_dir).items() if files else ():
        data = load_dump(path)
        samples = data["samples"]
        statuses = Counter(s["status"] for s in samples)
        rewards = scored_rewards(samples)
        turns = [len(s["turns"]) for s in samples]
        groups = {s["group_index"] for s in samples}
        finishes = Counter(t["finish_reason"] for s in samples for t in s["turns"])
        lines.append(
            f"step {k}: {len(samples)} samples in {len(groups)} groups, {sum(turns)} turns; "
            + ", ".join(f"{n} {status}" for status, n in statuses.most_common())
            + (f"; reward mean {statistics.fmean(rewards):.4g}" if rewards else "")
            + f"; turns {min(turns, default=0)}-{max(turns, default=0)}"
            + "; finish "
            + ", ".join(f"{reason} x{n}" for reason, n in finishes.most_common())
            + f"; {len(data['train']['samples'])} training sequences"
        )
        if step is not None:
            for s in samples:
                generated = sum(s["loss_mask"])
                lines.append(
                    f"  sample {s['index']} (group {s['group_index']}): {s['status']}, "
                    f"reward {'none' if s['status'] == FAILED else s['reward']}, "
                    f"{len(s['turns'])} turns, {generated} generated + {s['response_length'] - generated} observation "
                    f"tokens, termination {s['metadata'].get('termination')}"
                )
    for k, path in evals.items() if step is None else ():  # --step: that step's dump alone
        lines.append(f"eval after {k} steps: " + "; ".join(eval_dump_lines(load_dump(path))))
    return "\n".join(lines)


def eval_dump_lines(data: dict) -> list[str]:
    """Per dataset of an evaluation's dump: its trajectories, their statuses and reward mean."""
    out, start = [], 0
    for name, count in data["eval"]["datasets"]:
        samples = data["samples"][start : start + count]
        start += count
        statuses = Counter(s["status"] for s in samples)
        rewards = scored_rewards(samples)
        out.append(
            f"{name} {count} samples, "
            + ", ".join(f"{n} {status}" for status, n in statuses.most_common())
            + (f", reward mean {statistics.fmean(rewards):.4g}" if rewards else "")
        )
    return out
