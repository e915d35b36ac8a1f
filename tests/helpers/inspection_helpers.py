"""What the inspection tests share: the dump's documented fields, and readers of the trace."""

from pathlib import Path

SAMPLE_FIELDS = {
    "index",
    "group_index",
    "prompt",
    "tokens",
    "response",
    "response_length",
    "prompt_length",
    "label",
    "reward",
    "loss_mask",
    "rollout_log_probs",
    "token_versions",
    "weight_versions",
    "status",
    "metadata",
    "images",
    "multimodal_train_inputs",
    "routed_experts",
    "turns",
}
TURN_FIELDS = {
    "output_start",
    "output_end",
    "observation_end",
    "context_ids",
    "image_indices",
    "finish_reason",
    "weight_version",
    "engine_seconds",
    "env_seconds",
    "env_retries",
    "env_info",
    "num_images",
    "reward",
}
SEQUENCE_FIELDS = {
    "prompt_ids",
    "response_ids",
    "loss_mask",
    "rollout_log_probs",
    "token_versions",
    "reward",
    "trajectory_id",
    "group_id",
    "is_last_step",
    "turns",
    "stop_reason",
    "status",
    "multimodal_train_inputs",
    "routed_experts",
    "advantage",
    "train_log_probs",
}
TRAIN_FIELDS = {
    "samples",
    "advantages",
    "merge_metrics",
    "rollout_metrics",
    "metrics",
    "rollout_seconds",
    "rollout_started",
    "trained_groups",
    "note",
}


def dump_template(run_dir: Path) -> str:
    return str(run_dir / "dumps" / "rollout_{rollout_id}.pt")


def assert_dumped_train_log_probs(run_dir: Path, reduction: str) -> list[list[list[float]]]:
    """Each step's dump holds the trainer's log-prob of every response token of every training sequence,
    and their gap to the engine's, reduced as the loss reduces it (``token_mean`` or
    ``seq_mean_token_mean``, one mini-batch a step), is the step's logged
    ``train/train_rollout_logprob_abs_diff`` -> the log-probs, by step and sequence."""
    import json

    import pytest

    from slime_mt.config.checkpoint import dump_path
    from slime_mt.inspection.dumps import load_dump

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = []
    for row in rows:
        sequences = load_dump(dump_path(dump_template(run_dir), row["step"]))["train"]["samples"]
        counts = [sum(seq["loss_mask"]) for seq in sequences]
        live, total = sum(1 for c in counts if c), sum(counts)
        gap = 0.0
        for seq, count in zip(sequences, counts):
            assert len(seq["train_log_probs"]) == len(seq["response_ids"]) == len(seq["rollout_log_probs"])
            assert all(v <= 0.0 for v in seq["train_log_probs"])
            pairs = zip(seq["train_log_probs"], seq["rollout_log_probs"], seq["loss_mask"])
            trained = sum(abs(t - r) for t, r, m in pairs if m)
            if count:
                gap += trained / (total if reduction == "token_mean" else count * live)
        assert row["train/train_rollout_logprob_abs_diff"] == pytest.approx(gap, rel=1e-4, abs=1e-9)
        kept.append([seq["train_log_probs"] for seq in sequences])
    return kept


def assert_nested(events: list[dict]) -> None:
    """Within each lane, spans nest or are disjoint."""
    lanes: dict[tuple, list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            lanes.setdefault((e["pid"], e["tid"]), []).append(e)
    for lane, spans in lanes.items():
        stack: list[int] = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1], f"{lane}: {e['name']} at {e['ts']} overlaps its enclosing span"
            stack.append(end)


def lanes_by_name(events: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(process name, lane name) -> the lane's spans in time order."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    out: dict[tuple[str, str], list[dict]] = {}
    for e in sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"]):
        out.setdefault((processes[e["pid"]], threads[(e["pid"], e["tid"])]), []).append(e)
    return out


def assert_engine_calls_in_lanes(lanes: dict, samples: list[dict]) -> None:
    """Every turn of every dumped trajectory is an engine call on the trajectory's lane (in any
    process), inside its ``sample`` span: the calls that finished carry the turns' weight versions in
    order (a turn resumed after an update abort, or generated again, adds calls around it)."""
    by_lane = {lane: spans for (_, lane), spans in lanes.items()}
    for s in samples:
        spans = by_lane[f"sample {s['group_index']}/{s['index']}"]
        outer = [e for e in spans if e["name"] == "sample"]
        calls = [e for e in spans if e["name"] == "generate"]
        assert outer and len(calls) >= len(s["turns"])
        for call in calls:
            assert any(o["ts"] <= call["ts"] and call["ts"] + call["dur"] <= o["ts"] + o["dur"] for o in outer)
        finished = iter(
            str(c["args"].get("weight_version")) for c in calls if c["args"].get("finish_reason") != "abort"
        )
        assert all(t["weight_version"] in finished for t in s["turns"]), s["index"]  # a subsequence, in order


CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def open_page(browser, path: Path):
    """The page from its file, with every console error and page error collected."""
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on(
        "request", lambda r: errors.append(f"request {r.url}") if not r.url.startswith(("file:", "data:")) else None
    )
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='1']")
    return page, errors
