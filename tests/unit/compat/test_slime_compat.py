"""``--slime-compat``: plug-ins written against slime's API (tests/slime_plugins, in the style of slime's
Search-R1, geo3k VLM multi-turn and custom-rollout examples) train through ``slime-mt train``; slime's
names, ``append_response_tokens``, turns rebuilt from loss-mask runs, the drift of text sent to the
engine, and the built-in graders of ``--rm-type``."""

from argparse import Namespace

import pytest

from slime_mt.compat import SlimeCompat, install, rebuild_turns, text_drift
from slime_mt.config_parsing import parse_config
from slime_mt.errors import ConfigError, PluginError, RewardError
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.group_rollout import rollout_output
from slime_mt.rollout.rewards import GRADERS, rule_based_rm

install()
from slime.utils.types import Sample  # noqa: E402  (resolved by install())


def slime_sample(prompt_ids, **kw) -> Sample:
    return Sample(**{"index": 0, "group_index": 0, **kw}, tokens=list(prompt_ids))


def test_slime_modules_are_the_compat_modules_and_sample_is_a_slime_mt_sample():
    import slime.rollout.base_types as base_types
    import slime.utils.types as types
    from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
    from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group  # noqa: F401
    from slime.utils.http_utils import post  # noqa: F401
    from slime.utils.misc import load_function

    import slime_mt.compat.slime.utils.types as real
    import slime_mt.types as core

    assert types is real and issubclass(Sample, core.Sample)
    assert Sample.Status.TRUNCATED is core.Status.TRUNCATED
    assert load_function("slime.utils.types.Sample") is Sample
    same = [slime_sample([1], reward=r) for r in (1.0, 1.0)]
    assert check_reward_nonzero_std(Namespace(reward_key=None), same).keep is False
    assert check_reward_nonzero_std(Namespace(reward_key=None), [*same[:1], slime_sample([1], reward=0.0)]).keep
    output = base_types.RolloutFnTrainOutput(samples=[same], metrics={"custom/x": 2})
    assert rollout_output(output) == ([same], {"custom/x": 2.0})
    assert rollout_output([same]) == ([same], {})
    with pytest.raises(PluginError, match="returned a dict; expected list"):
        rollout_output({"samples": []})


def test_a_rollout_functions_groups_are_checked_and_a_reward_not_finite_fails_its_sample():
    """What a --rollout-function-path returns is named when it is not list[list[Sample]] (issue 67):
    a flat list, a group of groups, a tuple; a sample whose reward is NaN or infinite is FAILED, reward 0."""
    samples = [slime_sample([1], reward=r) for r in (1.0, 0.0)]
    with pytest.raises(PluginError, match=r"returned a flat list: item 0 is a Sample, not a group; expected "):
        rollout_output(samples)
    with pytest.raises(PluginError, match=r"item 0 of group 0 is a list, not a Sample \(nested one level too deep"):
        rollout_output([[samples]])
    with pytest.raises(PluginError, match=r"group 1 is a tuple; expected list\[list\[Sample\]\]: one list per prompt"):
        rollout_output([samples, tuple(samples)])
    bad = [slime_sample([1], reward=r) for r in (float("nan"), float("inf"), 0.5)]
    groups, _ = rollout_output([bad])
    assert groups == [bad] and [s.reward for s in bad] == [0.0, 0.0, 0.5]
    assert [s.status for s in bad] == [Sample.Status.FAILED, Sample.Status.FAILED, Sample.Status.PENDING]
    assert bad[1].metadata["error"] == "the rollout function gave the reward inf (not a finite number)"
    assert bad[0].metadata["error_cause"] == "reward not finite"


def test_append_response_tokens_keeps_masks_log_probs_versions_and_status_as_slime():
    sample = slime_sample([1, 2, 3])
    meta = {"finish_reason": {"type": "stop"}, "weight_version": "3"}
    sample.append_response_tokens(None, tokens=[4, 5], log_probs=[-0.1, -0.2], meta_info=meta, text="ab")
    sample.append_response_tokens(None, tokens=[6], trainable=False, text="!")
    sample.append_response_tokens(None, tokens=[7], log_probs=[-0.3], meta_info={"finish_reason": {"type": "length"}})
    assert (sample.tokens, sample.response_length, sample.response) == ([1, 2, 3, 4, 5, 6, 7], 4, "ab!")
    assert sample.loss_mask == [1, 1, 0, 1] and sample.rollout_log_probs == [-0.1, -0.2, 0.0, -0.3]
    assert sample.token_versions == [3, 3, -1, -1] and sample.weight_versions == ["3"]
    assert sample.status is Sample.Status.TRUNCATED and sample.effective_response_length == 3
    sample.append_response_tokens(None, tokens=[8], meta_info={"finish_reason": {"type": "abort"}})
    assert sample.rollout_log_probs is None and sample.status is Sample.Status.ABORTED  # not sampled as such
    with pytest.raises(ValueError, match="2 log-probs for 1 tokens"):
        sample.append_response_tokens(None, tokens=[9], log_probs=[0.0, 0.0])


def test_turns_rebuilt_from_loss_mask_runs_give_step_wise_samples_of_what_the_model_saw():
    sample = slime_sample([1, 2, 3], status=Sample.Status.TRUNCATED, reward=1.0)
    sample.append_response_tokens(None, tokens=[4, 5], log_probs=[-0.1, -0.2])
    sample.append_response_tokens(None, tokens=[6, 7], trainable=False)
    sample.append_response_tokens(None, tokens=[8], log_probs=[-0.3])
    rebuild_turns(sample)
    sample.validate()
    assert [(t.output_start, t.output_end, t.observation_end, t.finish_reason) for t in sample.turns] == [
        (3, 5, 7, "stop"),
        (7, 8, 8, "length"),
    ]
    steps, _ = finalize([sample], "step_wise", merge=False)
    assert [(s.prompt_ids, s.response_ids, s.rollout_log_probs) for s in steps] == [
        ([1, 2, 3], [4, 5], [-0.1, -0.2]),
        ([1, 2, 3, 4, 5, 6, 7], [8], [-0.3]),
    ]
    merged, _ = finalize([sample], "step_wise", merge=True)
    assert merged[0].response_ids == [4, 5, 6, 7, 8] and merged[0].loss_mask == [1, 1, 0, 0, 1]


def test_rebuilt_turns_count_the_images_before_each_output():
    pad = 151655
    sample = slime_sample([1, pad, pad, pad, 2])
    sample.append_response_tokens(None, tokens=[4], log_probs=[-0.1])
    sample.append_response_tokens(None, tokens=[5, pad, pad, 6], trainable=False)
    sample.append_response_tokens(None, tokens=[7], log_probs=[-0.2])
    rebuild_turns(sample, image_token_id=pad)
    assert [t.num_images for t in sample.turns] == [1, 2]


@pytest.fixture
def compat(tiny_paths):
    """A SlimeCompat on a real context (tiny Qwen2's tokenizer; no engine is called)."""
    from slime_mt.config import Config
    from slime_mt.rollout.context import RolloutContext

    cfg = Config()
    cfg.train.hf_checkpoint = str(tiny_paths["qwen2"])
    ctx = RolloutContext.create(cfg, cfg.train.hf_checkpoint, "http://localhost:30000")
    compat = SlimeCompat.activate(ctx)
    yield compat
    ctx.close()


def test_activate_gives_args_slime_names_and_adopt_reads_samples_as_slime(compat):
    args = compat.ctx.args
    assert (args.sglang_router_ip, args.sglang_router_port) == ("localhost", 30000)
    assert compat.is_engine("http://127.0.0.1:30000/generate") and not compat.is_engine(
        "http://127.0.0.1:8000/retrieve"
    )
    assert args.apply_chat_template_kwargs == {} and args.group_rm is False
    built = slime_sample([1, 2], response_length=3, loss_mask=None)  # tokens set by hand, slime's old style
    built.tokens += [3, 4, 5]
    built.rollout_log_probs = []
    compat.adopt(built)
    built.validate()
    assert built.loss_mask == [1, 1, 1] and built.rollout_log_probs is None and len(built.turns) == 1
    removed = slime_sample([1], remove_sample=True)
    removed.append_response_tokens(None, tokens=[2, 3], log_probs=[-0.1, -0.1])
    compat.adopt(removed)
    assert removed.loss_mask == [0, 0]


def test_text_drift_counts_the_tokens_the_engine_saw_differently(compat, qwen_tokenizer):
    """Trained: the prompt, then 'Hel' as generated and 'lo world' appended as its own tokens; the engine
    was sent the text and read 'Hello world' in one piece."""
    encode = lambda text: qwen_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt, first, observation, second = encode("Say:"), encode(" Hel"), encode("lo world"), encode("!")
    sample = slime_sample(prompt)
    sample.append_response_tokens(None, tokens=first, log_probs=[0.0] * len(first))
    sample.append_response_tokens(None, tokens=observation, trainable=False)
    sample.append_response_tokens(None, tokens=second, log_probs=[0.0])
    rebuild_turns(sample)
    seen_first, seen_second = encode("Say:"), encode("Say: Hello world")
    assert seen_second != prompt + first + observation  # the merge the engine made
    drift = text_drift(sample, [(seen_first, len(first)), (seen_second, 1)])
    assert drift > 0
    assert text_drift(sample, [(seen_first, len(first)), (prompt + first + observation, 1)]) == 0


@pytest.mark.parametrize(
    "grader, response, label, expected",
    [
        ("math", "so x = \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("math", "The answer is 42.", "42", 1.0),
        ("math", "\\boxed{3}", "2", 0.0),
        ("math", "\\boxed{2\\sqrt{2}}", ["\\sqrt{8}"], 1.0),
        ("deepscaler", "<think>maybe 2</think> it is \\boxed{3}", "3", 1.0),
        ("deepscaler", "it is \\boxed{3}", "3", 0.0),  # no </think>
        ("deepscaler", "<think>\\boxed{3}</think> it is \\boxed{4}", "3", 0.0),
        ("dapo", "work...\nAnswer: 1,000", "1000", {"score": 1.0, "acc": True, "pred": "1000"}),
        ("dapo", "Answer: $12$.", "13", {"score": -1.0, "acc": False, "pred": "12"}),
        ("f1", "The Eiffel Tower", ["eiffel tower", "paris"], 1.0),
        ("f1", "Eiffel tower in Paris", "eiffel tower", pytest.approx(2 * 0.5 * 1.0 / 1.5)),
        ("f1", "nothing", "eiffel tower", 0.0),
        ("gpqa", "Thinking... The answer is (C).", "C", 1.0),
        ("gpqa", "\\boxed{B}", "C", 0.0),
    ],
)
def test_graders(grader, response, label, expected):
    assert GRADERS[grader](response, label, {}) == expected


def test_gpqa_reads_an_option_text_label_through_the_rows_choices():
    choices = {"choices": ["red", "green", "blue"]}
    assert GRADERS["gpqa"]("Answer: B", "green", choices) == 1.0
    with pytest.raises(RewardError, match="neither a letter nor one of the row's metadata"):
        GRADERS["gpqa"]("Answer: B", "purple", choices)


def rm(args, sample):
    import asyncio

    return asyncio.run(rule_based_rm(args, sample))


def test_rm_type_boxed_prefix_row_override_and_reproducible_random():
    args = Namespace(rm_type="boxed_f1", rollout_seed=1)
    sample = slime_sample([1], response="Paris, obviously: \\boxed{Paris}", label="paris")
    assert rm(args, sample) == 1.0
    sample.response = "\\boxed{Lyon} Paris"
    assert rm(args, sample) == 0.0
    sample.metadata["rm_type"] = "f1"  # the row's grader wins
    assert rm(args, sample) == pytest.approx(2 / 3)

    def draw(index: int) -> float:
        sample = slime_sample([1], index=index, metadata={"rollout_id": 0})
        return rm(Namespace(rm_type="random", rollout_seed=1), sample)

    draws, again = [draw(i) for i in range(16)], [draw(i) for i in range(16)]
    assert draws == again and set(draws) == {0.0, 1.0}
    with pytest.raises(RewardError, match="'mathh': not a built-in grader"):
        rm(Namespace(rm_type="mathh"), slime_sample([1]))


def test_rm_type_is_checked_with_the_flags():
    with pytest.raises(ConfigError, match="--rm-type 'mathh': not a built-in grader; one of math, deepscaler"):
        parse_config(["--rm-type", "mathh"])
    with pytest.raises(ConfigError, match="--rm-type='remote_rm': needs --rm-url"):
        parse_config(["--rm-type", "remote_rm"])
    assert parse_config(["--rm-type", "boxed_math", "--slime-compat"]).rollout.slime_compat


def test_rm_hub_calls_the_custom_rm_for_a_sample_or_a_batch_else_the_rm_type_grader(tmp_path):
    import asyncio

    from slime.rollout.rm_hub import async_rm, batched_async_rm, extract_boxed_answer

    plugin = tmp_path / "my_rm.py"
    plugin.write_text(
        "async def one(args, sample, **kw):\n    return len(sample.response) + kw.get('bonus', 0)\n"
        "async def many(args, samples, **kw):\n    return [s.index * 10 for s in samples]\n"
    )
    samples = [slime_sample([1], index=i, response="\\boxed{Paris}" * (i + 1), label="Paris") for i in range(2)]
    graded = Namespace(rm_type="boxed_f1", custom_rm_path=None, rollout_seed=0)
    assert asyncio.run(async_rm(graded, samples[0])) == 1.0
    assert asyncio.run(batched_async_rm(graded, samples)) == [1.0, 1.0]
    custom = Namespace(rm_type=None, custom_rm_path=f"{plugin}:one")
    assert asyncio.run(async_rm(custom, samples[1], bonus=1)) == len(samples[1].response) + 1
    assert asyncio.run(batched_async_rm(Namespace(rm_type=None, custom_rm_path=f"{plugin}:many"), samples)) == [0, 10]
    samples[0].custom_rm_path = f"{plugin}:one"  # a sample's own reward function wins over the flags
    assert asyncio.run(async_rm(graded, samples[0])) == len(samples[0].response)
    assert extract_boxed_answer("a \\boxed{1} then \\boxed{x^{2}}") == "x^{2}"
    with pytest.raises(RewardError, match="no reward: set --rm-type"):
        asyncio.run(async_rm(Namespace(rm_type=None, custom_rm_path=None), slime_sample([1])))
