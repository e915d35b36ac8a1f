"""The agent gateway's options (``GatewayConfig``: ``slime_mt/gateway`` and ``rollouts.agent.generate``)
and the LLM judge's (``JudgeConfig``: ``envs/llm_judge.py``, and the code sandbox's isolation), with their
rules."""

from __future__ import annotations

from dataclasses import dataclass

from slime_mt.config.fields import group, option, require

AGENT_GENERATE = "rollouts.agent.generate"


@group("gateway")
@dataclass
class GatewayConfig:
    """The agent gateway (``slime_mt/gateway``) and the agent rollout (``rollouts.agent.generate``)."""

    agent_function_path: str | None = option(
        None,
        "rollouts.agent.generate: async run_agent(base_url, sample, args) -> float | dict, run once per sample "
        "against its own gateway session (module.fn or file.py:fn).",
    )
    agent_command: str | None = option(
        None,
        "rollouts.agent.generate: a harness program run once per sample (OPENAI_BASE_URL, OPENAI_API_KEY, "
        "ANTHROPIC_BASE_URL in its environment, the sample as JSON on stdin, the reward as JSON on stdout).",
    )
    agent_timeout: float | None = option(None, "Seconds an agent may run for one sample before it is FAILED.")
    gateway_host: str = option(
        "127.0.0.1", "Where the gateway listens; anything but loopback requires an API key (--gateway-api-key)."
    )
    gateway_port: int = option(0, "The gateway's port (0: a free one).")
    gateway_api_key: str | None = option(
        None,
        "The key harnesses must send (Authorization: Bearer, or x-api-key); unset beyond loopback: one is "
        "generated and given to the agent (args.gateway_api_key, OPENAI_API_KEY).",
    )
    gateway_enforce_sampling: bool = option(
        False, "Sample every gateway call at the rollout's temperature, top-p and top-k, whatever the harness asks."
    )
    tool_call_parser: str = option(
        "qwen", "How the gateway reads tool calls in model output.", choices=["qwen", "llama3_json", "none"]
    )
    reasoning_parser: str = option(
        "none", "How the gateway reads reasoning in model output.", choices=["qwen3", "none"]
    )
    gateway_session_concurrency: int = option(8, "Requests one gateway session may have in flight (more: HTTP 429).")


@group("judge")
@dataclass
class JudgeConfig:
    """The LLM judge (``envs/llm_judge.py``): where it runs, its rubric, its limits."""

    judge_model_path: str | None = option(
        None,
        "The judge model: its tokenizer and chat template render the rubric; alone, an embedded engine serving "
        "it is started in the rollout process.",
    )
    judge_engine_url: str | None = option(None, "A running SGLang-protocol engine serving --judge-model-path.")
    judge_use_policy: bool = option(False, "Judge with the policy's own engines (and tokenizer).")
    judge_template: str | None = option(
        None, "A file holding the rubric: a str.format template over {prompt}, {response} and {label}."
    )
    judge_parser_path: str | None = option(
        None,
        "file.py:fn or module.fn reading the judge's answer: fn(text) -> a score, or None when it holds none "
        "(default: the last 'Score: N', 'N/10' or JSON score).",
    )
    judge_timeout: float = option(60.0, "Seconds one judge call may take before it is tried again.")
    judge_retries: int = option(2, "Judge calls tried again after a timeout, an engine error or an unparseable answer.")
    judge_concurrency: int = option(8, "Judge calls in flight at once.")
    judge_max_new_tokens: int = option(256, "Tokens the judge may write per call.")
    judge_max_score: float = option(10.0, "The top of the judge's scale (rewards are the score over it).")
    judge_failure_reward: float | None = option(
        None, "The reward of a sample the judge could not score (default: the sample fails, out of its group)."
    )
    judge_pass_score: float | None = option(
        None, "envs.llm_judge episodes end when the judge's score reaches this (default: --judge-max-score)."
    )
    sandbox_allow_unisolated: bool = option(
        False,
        "envs.python_sandbox where the kernel refuses unprivileged user namespaces: run model code anyway, as this "
        "user without capabilities, with resource limits, a wall time, a fresh folder and a cleared environment "
        "only (the host process makes itself non-dumpable; files this user can read, its other processes and "
        "the network stay reachable; daemons may outlive a run). Default: refuse (the sample FAILS).",
    )


def validate_gateway(cfg) -> None:
    """The agent flags belong to ``rollouts.agent.generate``, which needs exactly one of them."""
    g, generate = cfg.gateway, cfg.rollout.custom_generate_function_path
    given = [
        flag
        for flag, value in (("agent_function_path", g.agent_function_path), ("agent_command", g.agent_command))
        if value
    ]
    if generate == AGENT_GENERATE:
        require(
            len(given) == 1,
            "custom_generate_function_path",
            generate,
            f"needs exactly one of --agent-function-path and --agent-command (given: {', '.join(given) or 'none'})",
        )
    elif given:
        require(False, given[0], getattr(g, given[0]), f"is run by --custom-generate-function-path {AGENT_GENERATE}")
    require(g.agent_timeout is None or g.agent_timeout > 0, "agent_timeout", g.agent_timeout, "must be > 0 seconds")
    require(
        g.gateway_session_concurrency >= 1, "gateway_session_concurrency", g.gateway_session_concurrency, "must be >= 1"
    )
    require(0 <= g.gateway_port < 65536, "gateway_port", g.gateway_port, "must be a port number (0: a free one)")


def validate_judge(cfg) -> None:
    """One place for the judge to run; positive limits."""
    j = cfg.judge
    require(
        not (j.judge_use_policy and (j.judge_model_path or j.judge_engine_url)),
        "judge_use_policy",
        j.judge_use_policy,
        "judges with the policy's engines; leave --judge-model-path and --judge-engine-url unset",
    )
    require(
        j.judge_engine_url is None or j.judge_model_path is not None,
        "judge_engine_url",
        j.judge_engine_url,
        "needs --judge-model-path (the judge's tokenizer and chat template)",
    )
    for key in ("judge_timeout", "judge_concurrency", "judge_max_new_tokens", "judge_max_score"):
        require(getattr(j, key) > 0, key, getattr(j, key), "must be > 0")
    require(j.judge_retries >= 0, "judge_retries", j.judge_retries, "must be >= 0")
