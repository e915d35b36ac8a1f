"""Turn-level rollout metrics from finished samples (a pure function of the samples)."""

from __future__ import annotations

import collections
import statistics

from slime_mt.types import Sample, Status


def rollout_metrics(groups: list[list[Sample]]) -> dict[str, float]:
    """Flat ``rollout/...`` metrics: rewards, turns, statuses, terminations, finish reasons, env
    retries and failures, tokens per turn, engine vs env time, observation share of tokens, turns whose
    context was not the append-only one (a context policy or a re-rendered history), and under
    ``--retokenize-chat-history`` the re-tokenization drift (tokens, and samples with any); under
    ``--slime-compat`` the drift of text sent to the engine and the samples whose turns were rebuilt."""
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    live = [s for s in samples if s.status != Status.FAILED]
    rewards = [float(s.reward or 0.0) for s in live]
    turns = [len(s.turns) for s in samples]
    generated = sum(s.generated_tokens for s in samples)
    observed = sum(t.observation_tokens for s in samples for t in s.turns)
    all_turns = [t for s in samples for t in s.turns]
    out: dict[str, float] = {
        "rollout/samples": len(samples),
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/pass_rate": sum(r > 0 for r in rewards) / len(rewards) if rewards else 0.0,
        "rollout/turns_mean": statistics.fmean(turns),
        "rollout/turns_max": max(turns),
        "rollout/response_tokens_mean": statistics.fmean(s.response_length for s in samples),
        "rollout/generated_tokens": generated,
        "rollout/observation_tokens": observed,
        "rollout/observation_share": observed / max(generated + observed, 1),
        "rollout/tokens_per_turn": generated / max(len(all_turns), 1),
        "rollout/engine_seconds": sum(t.engine_seconds for t in all_turns),
        "rollout/env_seconds": sum(t.env_seconds for t in all_turns),
        "rollout/env_retries": sum(t.env_retries for t in all_turns),
        "rollout/env_failures": sum(1 for s in samples if s.status == Status.FAILED),
        "rollout/rewritten_context_turns": sum(t.context_ids is not None for t in all_turns),
        "rollout/invalid_actions_per_turn": sum(s.metadata.get("invalid_actions", 0) for s in samples)
        / max(len(all_turns), 1),
    }
    drifts = [s.metadata["retokenize_drift_tokens"] for s in samples if "retokenize_drift_tokens" in s.metadata]
    if drifts:
        out["rollout/retokenize_drift_tokens"] = sum(drifts)
        out["rollout/retokenize_drift_samples"] = sum(d > 0 for d in drifts)
    text_drifts = [s.metadata["text_drift_tokens"] for s in samples if "text_drift_tokens" in s.metadata]
    if text_drifts:  # --slime-compat: plug-ins that sent text to the engine
        out["rollout/text_drift_tokens"] = sum(text_drifts)
        out["rollout/text_drift_samples"] = sum(d > 0 for d in text_drifts)
    rebuilt = sum(1 for s in samples if s.metadata.get("turns_rebuilt"))
    if rebuilt:
        out["rollout/samples_with_rebuilt_turns"] = rebuilt
    for n, count in sorted(collections.Counter(turns).items()):
        out[f"rollout/turns_hist/{n}"] = count
    out.update(env_fault_metrics(samples))
    without_turns = sum(1 for s in samples if s.response_length and not s.turns)
    if without_turns:
        out["rollout/samples_without_turns"] = without_turns
    for status, count in collections.Counter(s.status.value for s in samples).items():
        out[f"rollout/status/{status}"] = count
    for reason, count in collections.Counter(_termination(s) for s in samples).items():
        out[f"rollout/termination/{reason}"] = count
    for reason, count in collections.Counter(t.finish_reason for t in all_turns).items():
        out[f"rollout/finish_reason/{reason}"] = count
    out.update(env_info_metrics(all_turns))
    out.update(agent_metrics(samples))
    out.update(judge_metrics(samples))
    return out


def env_fault_metrics(samples: list[Sample]) -> dict[str, float]:
    """The env's turn control and faults: ``rollout/valid_turns_mean`` and ``valid_turns_hist/<n>``
    (the turns that count toward --max-turns: invalid actions aside), ``env_resets`` and
    ``env_resets_by/<exception>``, ``env_retries_by/<exception>``, ``episode_restarts``, and the mean
    over-long penalty where one was applied."""
    valid = [len(s.turns) - s.metadata.get("invalid_actions", 0) for s in samples]
    out: dict[str, float] = {
        "rollout/valid_turns_mean": statistics.fmean(valid),
        "rollout/env_resets": sum(s.metadata.get("env_resets", 0) for s in samples),
        "rollout/episode_restarts": sum(s.metadata.get("episode_restarts", 0) for s in samples),
    }
    for n, count in sorted(collections.Counter(valid).items()):
        out[f"rollout/valid_turns_hist/{n}"] = count
    for key, name in (("env_reset_causes", "env_resets_by"), ("env_retry_causes", "env_retries_by")):
        causes: collections.Counter = collections.Counter()
        for s in samples:
            causes.update(s.metadata.get(key) or {})
        out.update({f"rollout/{name}/{cause}": n for cause, n in sorted(causes.items())})
    penalties = [s.metadata["overlong_penalty"] for s in samples if "overlong_penalty" in s.metadata]
    if penalties:
        out["rollout/overlong_penalty_mean"] = statistics.fmean(penalties)
        out["rollout/overlong_penalized"] = sum(p < 0 for p in penalties)
    return out


def agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Agents behind the gateway (``rollouts.agent``): ``gateway/<counter>`` summed over the step's
    sessions (calls, kept_messages, rewritten_calls, tool_calls, malformed_tool_calls, ...) and
    ``agent/<key>``, the mean of each number the agents returned beside their reward."""
    totals: dict[str, float] = collections.defaultdict(float)
    values: dict[str, list[float]] = collections.defaultdict(list)
    for sample in samples:
        for key, value in (sample.metadata.get("gateway") or {}).items():
            totals[f"gateway/{key}"] += value
        for key, value in (sample.metadata.get("agent_metrics") or {}).items():
            values[f"agent/{key}"].append(value)
    return {**totals, **{key: statistics.fmean(v) for key, v in sorted(values.items())}}


def judge_metrics(samples: list[Sample]) -> dict[str, float]:
    """The LLM judge (``envs/llm_judge.py``): ``judge/calls``, ``cache_hits``, ``retries`` and
    ``failures`` summed over the step's samples, ``cache_hit_rate``, and ``seconds_per_call`` (per call
    that reached the engine)."""
    totals: dict[str, float] = collections.defaultdict(float)
    for sample in samples:
        for key, value in (sample.metadata.get("judge") or {}).items():
            totals[key] += value
    if not totals.get("calls"):
        return {}
    out = {f"judge/{key}": value for key, value in totals.items() if key != "seconds"}
    out["judge/cache_hit_rate"] = totals["cache_hits"] / totals["calls"]
    out["judge/seconds_per_call"] = totals["seconds"] / max(totals["calls"] - totals["cache_hits"], 1)
    return out


def env_info_metrics(turns) -> dict[str, float]:
    """``env/<key>``: the mean over the turns that reported it of every number (bools as 0/1) an
    environment's ``info`` carried, ``retryable`` aside."""
    values: dict[str, list[float]] = collections.defaultdict(list)
    for turn in turns:
        for key, value in turn.env_info.items():
            if key != "retryable" and isinstance(value, (int, float)) and value == value:  # not NaN
                values[key].append(float(value))
    return {f"env/{key}": statistics.fmean(v) for key, v in sorted(values.items())}


def _termination(sample: Sample) -> str:
    """Why the trajectory ended; ``error`` only for FAILED samples, ``unreported`` when a generate
    function finished one without saying."""
    if sample.status == Status.FAILED:
        return "error"
    return sample.metadata.get("termination") or "unreported"
