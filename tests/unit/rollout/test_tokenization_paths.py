"""The two other tokenization paths against the embedded engine: one assistant message for every
turn (``--no-conversation-multi-turn``) and a re-rendered history (``--retokenize-chat-history``).

The models are "chain" copies of the tiny Qwen3 (see ``rollout_helpers.chain_model``) with the real
Qwen tokenizer: the Qwen2.5 template, and Qwen3's official one. They answer "Direct answer" as the
non-canonical split ``" ans" + "wer"`` (re-tokenizing gives ``" answer"``), or "Calling tool", or
think first, so re-tokenization drift has a known size.
"""

import pytest
import torch

from slime_mt.algo.losses import LossInputs, policy_loss
from slime_mt.config import AlgoConfig
from slime_mt.config_parsing import build_config
from slime_mt.errors import ConfigError


def test_tokens_without_rollout_log_probs_refuse_tis_and_skip_the_diff_metric():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    x = LossInputs(
        log_probs=lp.clone().requires_grad_(),
        old_log_probs=lp,
        advantages=torch.ones(3),
        rollout_log_probs=torch.tensor([-1.1, float("nan"), float("nan")]),
        weights=torch.tensor([1 / 3] * 3),
        seq_ids=torch.tensor([0, 1, 1]),
    )
    loss, metrics = policy_loss(x, AlgoConfig())
    assert torch.isfinite(loss)
    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(0.1 / 3)  # over the sampled token only
    x.rollout_log_probs = torch.full((3,), float("nan"))
    assert "train_rollout_logprob_abs_diff" not in policy_loss(x, AlgoConfig())[1]
    with pytest.raises(ValueError, match="--use-tis needs rollout log-probs"):
        policy_loss(x, AlgoConfig(use_tis=True))


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"retokenize_chat_history": True, "use_tis": True}, "--use-tis needs the rollout log-probs"),
        (
            {"retokenize_chat_history": True, "context_policy": "window:2", "sample_format": "step_wise"},
            "cannot be combined with a context policy",
        ),
        (
            {"conversation_multi_turn": False, "retokenize_chat_history": True},
            "--no-conversation-multi-turn .* cannot be combined with --retokenize-chat-history",
        ),
        (
            {"conversation_multi_turn": False, "context_policy": "strip_thinking", "sample_format": "step_wise"},
            "--no-conversation-multi-turn .* cannot be combined with a context policy",
        ),
        ({"observation_template": "<obs></obs>"}, "--observation-template.*exactly once"),
    ],
)
def test_path_flags_that_cannot_work_together_are_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        build_config(settings)


def test_tis_with_retokenized_step_wise_samples_is_allowed():
    cfg = build_config({"retokenize_chat_history": True, "use_tis": True, "sample_format": "step_wise"})
    assert cfg.rollout.retokenize_chat_history and cfg.algo.use_tis
