"""Context policies without an engine: the tokens of the Qwen3 "chain" model the integration tests run
on (its real tokenizer and official template), the errors of bad policy specs, of concat with a
rewriting policy and of a user policy of the wrong shape (tests/integration/rollout/test_context_policy.py
runs the policies against the embedded engine)."""

import asyncio

import pytest
from rollout_helpers import (
    ANS,
    ANSWER,
    CALLING,
    CHECK,
    DIRECT,
    END_THINK,
    LET,
    ME,
    NL2,
    THINK,
    TOOL,
    WER,
)
from transformers import AutoTokenizer

from slime_mt.assets import qwen3_reference_tokenizer_dir
from slime_mt.config.rollout import parse_context_policy
from slime_mt.config_parsing import build_config
from slime_mt.errors import ConfigError, ContextPolicyError
from slime_mt.rollout.context_policy import load_policy


@pytest.fixture(scope="module")
def reference():
    return AutoTokenizer.from_pretrained(str(qwen3_reference_tokenizer_dir()))


def test_the_tokens_of_the_chain_model(reference):
    assert reference.encode(" ans", add_special_tokens=False) == [ANS]
    assert reference.encode("wer", add_special_tokens=False) == [WER]
    assert reference.encode("Direct answer", add_special_tokens=False) == [DIRECT, ANSWER]
    assert (
        reference.decode([THINK, LET, ME, CHECK, END_THINK, NL2, CALLING, TOOL])
        == "<think>Let me check</think>\n\nCalling tool"
    )


@pytest.mark.parametrize(
    "spec,message",
    [
        ("windows:2", "unknown policy"),
        ("window", "needs a count"),
        ("window:-1", "needs a count"),
        ("strip_thinking:3", "takes no argument"),
        ("keep_last_images:x", "needs a count"),
    ],
)
def test_bad_policy_specs_name_the_flag(spec, message):
    with pytest.raises(ContextPolicyError, match=message):
        parse_context_policy(spec)
    with pytest.raises(ConfigError, match="--context-policy"):
        build_config({"context_policy": spec, "sample_format": "step_wise"})


@pytest.mark.parametrize("setting", [{"context_policy": "window:1"}, {"context_policy_path": "x.py:f"}])
def test_concat_with_a_rewriting_policy_is_a_config_error(setting):
    with pytest.raises(ConfigError, match="use --sample-format step_wise"):
        build_config(setting)


def test_a_user_policy_must_fit_the_signature_and_return_messages(tmp_path):
    from slime_mt.errors import PluginError

    (tmp_path / "p.py").write_text(
        "def bad(sample):\n    return []\n\ndef text(args, sample, prompt, turns):\n    return 'hello'\n"
    )
    with pytest.raises(PluginError, match="--context-policy-path"):
        load_policy(path=f"{tmp_path}/p.py:bad")
    from slime_mt.rollout.context_policy import apply_policy

    with pytest.raises(ContextPolicyError, match="must return a list of messages"):
        asyncio.run(apply_policy(load_policy(path=f"{tmp_path}/p.py:text"), None, None, [], []))
