"""The data and rollout options (``DataConfig``, ``RolloutConfig``) and their rules: the turn loop's
budgets, sampling, group sizes, the context a model sees, the asynchronous modes, the reward. The syntax
of the values these flags take lives here too (``--context-policy``, ``--rm-type``), read by the modules
that act on them."""

from __future__ import annotations

from dataclasses import dataclass

from slime_mt.config.fields import group, option, positive, require
from slime_mt.errors import ConfigError, ContextPolicyError, RewardError

# --context-policy's built-in policies -> the keyword their count is passed as (None: they take none)
CONTEXT_POLICIES: dict[str, str | None] = {
    "append": None,
    "strip_thinking": None,
    "keep_last_images": "k",
    "window": "n",
}
# --rm-type's built-in graders (rollout/rewards.py), and the remote one; each also as boxed_<name>
RM_TYPES = ("math", "deepscaler", "dapo", "f1", "gpqa", "random", "remote_rm")
BOXED_PREFIX = "boxed_"


@group("data")
@dataclass
class DataConfig:
    """Prompt datasets (jsonl or parquet) and how rows become prompts."""

    prompt_data: str | None = option(None, "Training prompts: a .jsonl or .parquet file.")
    input_key: str = option("prompt", "Row key holding the prompt (text or chat messages).")
    label_key: str | None = option(
        None,
        "Row key holding the reference answer; every row must have it. Not given: 'label', where a row has it "
        "(rows without get label None, counted in a warning).",
    )
    metadata_key: str = option("metadata", "Row key holding a dict passed to the env and reward.")
    tool_key: str | None = option(None, "Row key holding tool schemas for the chat template.")
    multimodal_keys: dict | None = option(
        None, 'JSON map from modality to row key, e.g. \'{"image": "images"}\'.', json=True
    )
    apply_chat_template: bool = option(False, "Render prompts with the tokenizer's chat template.")
    chat_template: str | None = option(
        None,
        "A Jinja chat template file the rollout renders with instead of the model folder's (for a folder "
        "without one, or to change it); 'slime-mt check-template --chat-template' checks it first.",
    )
    rollout_shuffle: bool = option(False, "Shuffle prompts every epoch.")
    rollout_seed: int = option(42, "Seed of the prompt shuffle and of sampling.")


@group("rollout")
@dataclass
class RolloutConfig:
    """The rollout: plug-in paths, the turn loop's budgets, sampling, group sizes."""

    rollout_function_path: str = option(
        "slime_mt.rollout.group_rollout.generate_rollout", "Rollout function: module.fn or file.py:fn."
    )
    custom_generate_function_path: str = option(
        "rollouts.multi_turn.generate", "Per-sample generate function: module.fn or file.py:fn."
    )
    custom_rm_path: str | None = option(None, "Async reward function rm(args, sample) -> float | dict.")
    reward_key: str | None = option(None, "Key to read when the reward function returns a dict.")
    rm_type: str | None = option(
        None,
        "Built-in rule-based reward when no --custom-rm-path is set (slime's names): math, deepscaler, dapo, "
        "f1, gpqa, random, remote_rm, each also as boxed_<name>; a row's metadata['rm_type'] overrides it.",
    )
    rm_url: str | None = option(None, "--rm-type remote_rm: the URL that grades {prompt, response, label}.")
    overlong_buffer_len: int = option(
        0,
        "DAPO's soft over-long punishment: a sample whose generated tokens L exceed Lmax - this buffer gets "
        "min(-(L - (Lmax - buffer)) / buffer * factor, 0), at least -factor, added to its reward (0: off).",
    )
    overlong_penalty_factor: float = option(1.0, "The largest over-long penalty (--overlong-buffer-len).")
    overlong_max_len: int | None = option(
        None,
        "Lmax of the over-long penalty, in generated tokens of the whole trajectory (default: "
        "--rollout-max-response-len; set it for multi-turn episodes).",
    )

    @property
    def overlong_lmax(self) -> int:
        """Lmax of the over-long penalty: ``--overlong-max-len``, else ``--rollout-max-response-len``."""
        return self.overlong_max_len if self.overlong_max_len is not None else self.rollout_max_response_len

    slime_compat: bool = option(
        False,
        "Run plug-ins written against slime's API: 'import slime...' resolves to slime_mt.compat, samples "
        "are slime Samples that arrive as slime gives them (rendered text prompt, no tokens), rewards follow "
        "slime (a reward the generate function set is kept). docs: Bring your slime plug-ins (docs/slime.md).",
    )
    rollout_interaction_env_path: str | None = option(
        None, "Environment module (or file.py) defining build_env(sample=None, args=None, **kw)."
    )
    max_turns: int = option(8, "Maximum LLM turns per trajectory.")
    rollout_max_response_len: int = option(1024, "Maximum new tokens per turn.")
    rollout_max_context_len: int = option(4096, "Maximum prompt + response tokens per trajectory.")
    rollout_max_prompt_len: int | None = option(
        None,
        "Leave out, at load, prompts longer than this many tokens (as rendered, tools and images included; "
        "slime's flag). Prompts that leave no room in --rollout-max-context-len are always left out.",
    )
    rollout_temperature: float = option(1.0, "Sampling temperature (> 0).")
    rollout_top_p: float = option(1.0, "Nucleus sampling threshold in (0, 1].")
    rollout_top_k: int = option(-1, "Top-k sampling; -1 disables.")
    rollout_stop: list[str] | None = option(None, "Stop strings.", nargs="+")
    rollout_stop_token_ids: list[int] | None = option(None, "Stop token ids.", nargs="+")
    n_samples_per_prompt: int = option(8, "Trajectories per prompt (one GRPO group).")
    rollout_batch_size: int = option(32, "Prompts per rollout step.")
    over_sampling_batch_size: int | None = option(
        None, "Prompts to sample per round when a dynamic sampling filter drops groups."
    )
    dynamic_sampling_filter_path: str | None = option(None, "Group filter fn(args, samples) -> bool.")
    num_rollout: int = option(100, "Number of rollout/train steps.")
    rollout_concurrency: int = option(64, "Trajectories in flight at once.")
    sample_format: str = option(
        "concat", "Training sample format: one per trajectory or one per turn.", choices=["concat", "step_wise"]
    )
    merge_step_wise: bool = option(False, "Merge step-wise samples whose context extends the previous one.")
    context_policy: str = option(
        "append",
        "What the model sees each turn: append, strip_thinking, keep_last_images:K or window:N "
        "(any but append needs --sample-format step_wise).",
    )
    context_policy_path: str | None = option(
        None, "A user context policy policy(args, sample, prompt, turns) -> messages: module.fn or file.py:fn."
    )
    conversation_multi_turn: bool = option(
        True,
        "Each observation is its own chat message; --no-conversation-multi-turn keeps every turn in one "
        "assistant message, observations as raw text in --observation-template (token-in/token-out).",
    )
    observation_template: str = option(
        "\n<observation>{observation}</observation>\n",
        "--no-conversation-multi-turn: the text around an observation, with {observation} where it goes.",
    )
    retokenize_chat_history: bool = option(
        False,
        "Render and tokenize the whole conversation for every turn (no token-in/token-out); concat "
        "samples are the final render with its assistant mask and no rollout log-probs.",
    )
    mask_truncated: bool = option(False, "Give TRUNCATED and ABORTED samples loss mask 0.")
    async_mode: bool = option(
        False,
        "slime's train_async: roll out step k+1 while step k trains (one step off-policy).",
        flag="--async",
        aliases=["async"],
    )
    fully_async: bool = option(
        False,
        "Generate groups continuously into a buffer (rank 0's rollout manager); "
        "weights are updated in the middle of generation; each step trains the next "
        "--rollout-batch-size finished groups within --max-staleness.",
    )
    max_staleness: int = option(
        1,
        "--fully-async: a trained token was generated at most this many weight versions "
        "before the one trained (0: on-policy). Generation is throttled to the bound and "
        "groups beyond it are dropped and counted (AReaL's max_head_offpolicyness; with "
        "--use-decoupled-loss they are trained).",
    )
    partial_rollout: bool = option(
        False,
        "--fully-async: a turn a weight update interrupts keeps its tokens (with "
        "their log-probs and version) and continues from them; without it the turn is "
        "generated again.",
    )
    mask_offpolicy_in_partial_rollout: bool = option(
        False,
        "--partial-rollout: instead of dropping a group with tokens beyond --max-staleness, give those "
        "tokens loss mask 0 (they stay as context) and train the rest.",
    )
    max_tokens_in_flight: int | None = option(
        None,
        "--fully-async: besides the group throttle, a group starts only while the trajectories in flight hold "
        "fewer tokens than this (their contexts so far: prompt, generated and observation tokens), so a few "
        "long episodes keep the engines' KV cache to themselves instead of sharing it with new groups.",
    )
    oldest_groups_first: bool = option(
        False,
        "--fully-async: every engine request carries its group's start version as a priority, and the engines "
        "serve the oldest groups' turns first, so the long trajectories, started early and resumed across "
        "updates, finish within --max-staleness instead of waiting behind new groups' first turns. Launched "
        "engines get it (SGLang: --enable-priority-scheduling; vLLM: --scheduling-policy priority; the embedded "
        "engine always schedules by priority); an --engine-url server must have been started with it.",
    )
    max_env_retries_per_turn: int = option(2, "Retries of a failing env step within one turn.")
    max_invalid_actions_per_turn: int = option(
        2,
        "Turns in a row the env may reject as invalid actions (InvalidActionError, info['invalid_action']); "
        "they do not count toward --max-turns; one more ends the sample TRUNCATED (invalid_actions).",
    )
    max_env_resets: int = option(
        2,
        "Resets of the env per sample after RecoverableEnvError or a failing reset() (each replays the episode's "
        "actions); one more fails the sample.",
    )
    max_failed_steps: int = option(
        1, "Stop the run after this many consecutive steps in which every sample failed (nothing to train)."
    )
    env_step_timeout: float | None = option(None, "Seconds before an env step counts as a retryable fault.")
    env_num_workers: int = option(
        0,
        "Run the environments (build_env, reset, step, close) in this many Ray actors spread over the "
        "cluster's nodes (--ray-address; none: a local Ray) instead of threads of the rollout process; "
        "a worker that dies is restarted and its episodes rebuilt. 0: in-process.",
    )
    env_worker_num_cpus: float = option(1.0, "--env-num-workers: CPUs Ray reserves for each environment worker.")
    rollout_num_processes: int = option(
        1,
        "Run the groups' trajectories (generate, environment, reward) in this many Ray actors spread over "
        "the cluster's nodes (--ray-address; none: a local Ray), for when one process cannot keep the "
        "engines busy; data, the dynamic-sampling filter, staleness and metrics stay in the rollout role's "
        "process, so each group is drawn and trained once. 1: in the rollout role's process.",
    )
    rollout_process_num_cpus: float = option(
        1.0, "--rollout-num-processes: CPUs Ray reserves for each rollout process."
    )


def parse_context_policy(spec: str) -> tuple[str, int | None]:
    """``"window:3"`` -> ("window", 3); raises ContextPolicyError naming the flag."""
    name, _, value = spec.partition(":")
    if name not in CONTEXT_POLICIES:
        raise ContextPolicyError(
            f"--context-policy {spec!r}: unknown policy; choose from append, strip_thinking, "
            f"keep_last_images:K, window:N, or pass --context-policy-path module.fn"
        )
    if CONTEXT_POLICIES[name] is None:
        if value:
            raise ContextPolicyError(f"--context-policy {spec!r}: {name} takes no argument")
        return name, None
    if not value.isdigit():
        raise ContextPolicyError(f"--context-policy {spec!r}: {name} needs a count >= 0, e.g. {name}:2")
    return name, int(value)


def rewrites_history(spec: str = "append", path: str | None = None) -> bool:
    """Whether the configured policy may show the model something other than the append-only context."""
    return bool(path) or parse_context_policy(spec)[0] != "append"


def check_rm_type(name: str, where: str = "--rm-type") -> None:
    """Raise RewardError unless ``name`` is a grader (optionally ``boxed_``-prefixed) or remote_rm."""
    base = name.removeprefix(BOXED_PREFIX)
    if base not in RM_TYPES:
        names = ", ".join(RM_TYPES)
        raise RewardError(f"{where} {name!r}: not a built-in grader; one of {names} (each also as boxed_<name>)")


def validate_rollout(cfg) -> None:
    """The rollout's budgets, workers, sampling and reward; the context it trains; its asynchronous modes."""
    r = cfg.rollout
    counts = ("max_turns", "rollout_max_response_len", "rollout_max_context_len", "n_samples_per_prompt")
    positive(r, (*counts, "rollout_batch_size", "num_rollout", "rollout_concurrency"))
    positive(r, ("over_sampling_batch_size",), optional=True)
    _validate_workers(r)
    _validate_budgets(r)
    _validate_sampling(r)
    _validate_context(cfg)
    if r.over_sampling_batch_size is not None:
        require(
            r.over_sampling_batch_size >= r.rollout_batch_size,
            "over_sampling_batch_size",
            r.over_sampling_batch_size,
            f"must be >= --rollout-batch-size={r.rollout_batch_size}",
        )
    _validate_async(r)
    if r.rm_type:
        try:
            check_rm_type(r.rm_type)
        except RewardError as e:
            raise ConfigError(str(e)) from None
        require(r.rm_type != "remote_rm" or bool(r.rm_url), "rm_type", r.rm_type, "needs --rm-url")


def _validate_workers(r: RolloutConfig) -> None:
    require(r.env_num_workers >= 0, "env_num_workers", r.env_num_workers, "must be >= 0")
    require(r.env_worker_num_cpus > 0, "env_worker_num_cpus", r.env_worker_num_cpus, "must be > 0")
    require(
        not r.env_num_workers or r.rollout_interaction_env_path,
        "env_num_workers",
        r.env_num_workers,
        "runs the --rollout-interaction-env-path environments, and none is given",
    )
    require(r.rollout_num_processes >= 1, "rollout_num_processes", r.rollout_num_processes, "must be >= 1")
    require(r.rollout_process_num_cpus > 0, "rollout_process_num_cpus", r.rollout_process_num_cpus, "must be > 0")
    require(
        r.rollout_num_processes == 1 or not r.slime_compat,
        "rollout_num_processes",
        r.rollout_num_processes,
        "runs slime_mt's samples in other processes; --slime-compat adopts slime's in the rollout role's "
        "process only (use 1 with --slime-compat)",
    )


def _validate_budgets(r: RolloutConfig) -> None:
    require(r.max_env_retries_per_turn >= 0, "max_env_retries_per_turn", r.max_env_retries_per_turn, "must be >= 0")
    require(
        r.max_invalid_actions_per_turn >= 0,
        "max_invalid_actions_per_turn",
        r.max_invalid_actions_per_turn,
        "must be >= 0",
    )
    require(r.max_env_resets >= 0, "max_env_resets", r.max_env_resets, "must be >= 0")
    require(r.overlong_buffer_len >= 0, "overlong_buffer_len", r.overlong_buffer_len, "must be >= 0")
    require(r.overlong_penalty_factor >= 0, "overlong_penalty_factor", r.overlong_penalty_factor, "must be >= 0")
    require(
        r.overlong_buffer_len < r.overlong_lmax or not r.overlong_buffer_len,
        "overlong_buffer_len",
        r.overlong_buffer_len,
        f"must be below the over-long Lmax ({r.overlong_lmax}: --overlong-max-len, else --rollout-max-response-len)",
    )
    require(r.max_failed_steps >= 1, "max_failed_steps", r.max_failed_steps, "must be >= 1")
    require(
        r.env_step_timeout is None or r.env_step_timeout > 0,
        "env_step_timeout",
        r.env_step_timeout,
        "must be > 0 seconds",
    )


def _validate_sampling(r: RolloutConfig) -> None:
    require(
        r.rollout_temperature > 0,
        "rollout_temperature",
        r.rollout_temperature,
        "must be > 0 (RL trains on sampled tokens; greedy decoding has no log-prob distribution)",
    )
    require(0 < r.rollout_top_p <= 1, "rollout_top_p", r.rollout_top_p, "must be in (0, 1]")
    require(
        r.rollout_top_k == -1 or r.rollout_top_k > 0, "rollout_top_k", r.rollout_top_k, "must be -1 (off) or positive"
    )
    require(
        r.rollout_max_response_len <= r.rollout_max_context_len,
        "rollout_max_response_len",
        r.rollout_max_response_len,
        f"exceeds --rollout-max-context-len={r.rollout_max_context_len}",
    )


def _validate_context(cfg) -> None:
    """What the model sees each turn, and what is trained of it: token-in/token-out unless a policy or
    --retokenize-chat-history rewrites the history, which then trains step-wise samples."""
    r = cfg.rollout
    try:
        rewrites = rewrites_history(r.context_policy, r.context_policy_path)
    except ContextPolicyError as e:
        raise ConfigError(str(e)) from None
    if rewrites and r.sample_format == "concat":
        policy = (
            f"--context-policy-path={r.context_policy_path!r}"
            if r.context_policy_path
            else f"--context-policy={r.context_policy!r}"
        )
        raise ConfigError(
            f"{policy} rewrites what the model sees, so one concatenated sequence per trajectory "
            f"would train contexts the model never saw: use --sample-format step_wise"
        )
    require(
        r.observation_template.count("{observation}") == 1,
        "observation_template",
        r.observation_template,
        "must contain {observation} exactly once",
    )
    if not r.conversation_multi_turn and (rewrites or r.retokenize_chat_history):
        other = "--retokenize-chat-history" if r.retokenize_chat_history else "a context policy that rewrites history"
        raise ConfigError(
            f"--no-conversation-multi-turn keeps every turn in one assistant message, token-in/"
            f"token-out; it cannot be combined with {other}"
        )
    if rewrites and r.retokenize_chat_history:
        raise ConfigError(
            "--retokenize-chat-history renders the whole conversation every turn; it cannot be "
            "combined with a context policy that rewrites history (use one or the other)"
        )
    if r.retokenize_chat_history and r.sample_format == "concat" and cfg.algo.use_tis:
        raise ConfigError(
            "--use-tis needs the rollout log-probs of the trained tokens, but with "
            "--retokenize-chat-history and --sample-format concat the trained assistant tokens are "
            "re-tokenized and were never sampled as such: drop --use-tis or use --sample-format "
            "step_wise (which trains the generated tokens with their log-probs)"
        )


def _validate_async(r: RolloutConfig) -> None:
    require(r.max_staleness >= 0, "max_staleness", r.max_staleness, "must be >= 0 (0: on-policy)")
    if r.fully_async and r.async_mode:
        raise ConfigError(
            "--fully-async and --async are two modes: --async rolls out one step ahead, "
            "--fully-async generates continuously; pass one"
        )
    if r.fully_async and r.rollout_function_path != RolloutConfig.rollout_function_path:
        raise ConfigError(
            f"--fully-async streams groups through --custom-generate-function-path; the batch "
            f"--rollout-function-path {r.rollout_function_path} cannot be streamed (keep the default)"
        )
    if r.fully_async and r.retokenize_chat_history and r.sample_format == "concat":
        raise ConfigError(
            "--fully-async with --retokenize-chat-history and --sample-format concat: the staleness bound, its "
            "masking and TIS need the weight version and rollout log-prob of every trained token, and a concat "
            "sample of a re-rendered history trains re-tokenized text that has neither (the bound would be off); "
            "use --sample-format step_wise, which trains each turn's generated tokens as generated"
        )
    if r.partial_rollout and not r.fully_async:
        raise ConfigError(
            "--partial-rollout resumes turns that a weight update interrupts, which only "
            "--fully-async does: add --fully-async"
        )
    if r.max_tokens_in_flight is not None:
        require(r.max_tokens_in_flight > 0, "max_tokens_in_flight", r.max_tokens_in_flight, "must be > 0")
        require(r.fully_async, "max_tokens_in_flight", r.max_tokens_in_flight, "throttles --fully-async: add it")
        require(
            r.rollout_num_processes == 1,
            "max_tokens_in_flight",
            r.max_tokens_in_flight,
            f"counts the tokens of the trajectories in this process; --rollout-num-processes="
            f"{r.rollout_num_processes} runs them in others",
        )
    if r.oldest_groups_first:
        require(r.fully_async, "oldest_groups_first", True, "orders the groups of --fully-async: add it")
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        raise ConfigError(
            "--mask-offpolicy-in-partial-rollout masks the old tokens of resumed turns: add --partial-rollout"
        )
