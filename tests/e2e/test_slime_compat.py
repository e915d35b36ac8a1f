"""``--slime-compat``: plug-ins written against slime's API (tests/slime_plugins, in the style of slime's
Search-R1, geo3k VLM multi-turn and custom-rollout examples) train through ``slime-mt train``; slime's
names, ``append_response_tokens``, turns rebuilt from loss-mask runs, the drift of text sent to the
engine, and the built-in graders of ``--rm-type``."""

import json
import os
import subprocess
import sys
import threading
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from PIL import Image

from slime_mt.compat import SlimeCompat, install, rebuild_turns, text_drift
from slime_mt.config import ConfigError
from slime_mt.config_parsing import parse_config
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.group_rollout import RolloutError, rollout_output
from slime_mt.rollout.rewards import GRADERS, RewardError, rule_based_rm

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "tests" / "slime_plugins"
STOPS = [str(t) for t in range(3, 151643, 3)] + ["151645"]  # a random model ends its turns in ~3 tokens
DRIFT_WARNING = "WARNING slime_mt.compat: a plug-in sent text to the engine (POST /generate with 'text') instead"

install()
from slime.utils.types import Sample  # noqa: E402  (resolved by install())


def slime_sample(prompt_ids, **kw) -> Sample:
    return Sample(**{"index": 0, "group_index": 0, **kw}, tokens=list(prompt_ids))


# ---------------------------------------------------------------- slime's names


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
    with pytest.raises(RolloutError, match="returned a dict; expected list"):
        rollout_output({"samples": []})


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


# ---------------------------------------------------------------- --rm-type graders


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


def test_remote_rm_posts_the_sample_to_rm_url():
    seen = []

    class Grader(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            answer = json.dumps({"score": float(body["response"] == body["label"])}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Grader)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = Namespace(rm_type="remote_rm", rm_url=f"http://127.0.0.1:{server.server_port}/grade")
        assert rm(args, slime_sample([1], prompt="q", response="4", label="4")) == {"score": 1.0}
        assert seen == [{"prompt": "q", "response": "4", "label": "4"}]
    finally:
        server.shutdown()


def test_rm_type_is_checked_with_the_flags():
    with pytest.raises(ConfigError, match="--rm-type 'mathh': not a built-in grader; one of math, deepscaler"):
        parse_config(["--rm-type", "mathh"])
    with pytest.raises(ConfigError, match="--rm-type='remote_rm': needs --rm-url"):
        parse_config(["--rm-type", "remote_rm"])
    assert parse_config(["--rm-type", "boxed_math", "--slime-compat"]).rollout.slime_compat


# ---------------------------------------------------------------- slime plug-ins, two steps each


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slime_data")
    rows = [
        {"prompt": "What is the capital of France? Search, then answer in <answer></answer>.", "label": "Paris"},
        {"prompt": "Which is the tallest mountain? Search, then answer in <answer></answer>.", "label": "Everest"},
    ]
    (folder / "search.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Image.new("RGB", (64, 64), (200, 30, 30)).save(folder / "figure.png")
    figures = [
        {"messages": [{"role": "user", "content": "<image>What is x? Answer in \\boxed{}."}], "label": "3"},
        {"messages": [{"role": "user", "content": "<image>Find the angle y."}], "label": "45"},
    ]
    (folder / "figures.jsonl").write_text("".join(json.dumps({**r, "images": ["figure.png"]}) + "\n" for r in figures))
    return folder


def train(model: Path, run: Path, *flags: str) -> subprocess.CompletedProcess:
    """``slime-mt train --slime-compat`` from the plug-ins' folder (module-form paths, as slime runs them)."""
    cmd = [
        *(sys.executable, "-m", "slime_mt.cli", "train", "--slime-compat", "--hf-checkpoint", str(model)),
        *("--apply-chat-template", "--rollout-max-context-len", "1024", "--rollout-stop-token-ids", *STOPS),
        *("--n-samples-per-prompt", "4", "--micro-batch-size", "4", "--num-rollout", "2", "--log-dir", str(run)),
        *flags,
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=PLUGINS, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def rows_of(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    return rows


@pytest.mark.slow
def test_a_search_agent_that_sends_text_trains_with_its_reward_and_the_drift_counted(tmp_path, data, tiny_paths):
    run = tmp_path / "run"
    proc = train(
        tiny_paths["qwen2"],
        run,
        *("--prompt-data", str(data / "search.jsonl"), "--rollout-max-response-len", "24"),
        *("--custom-generate-function-path", "search_generate.generate"),
        *("--custom-rm-path", "search_generate.reward_func"),
        *("--rollout-batch-size", "2", "--global-batch-size", "8"),
    )
    for text in (proc.stderr, (run / "train.log").read_text()):
        assert len([line for line in text.splitlines() if line.startswith(DRIFT_WARNING)]) == 1  # once per run
    rows = rows_of(run)
    rewards = [json.loads(line) for line in (run / "rewards.jsonl").read_text().splitlines()]
    for row in rows:
        mine = [r["reward"] for r in rewards if r["step"] == row["step"]]
        assert len(mine) == 8 and row["rollout/reward_mean"] == pytest.approx(sum(mine) / 8, abs=1e-12)
        assert row["rollout/samples_with_rebuilt_turns"] == 8 and row["rollout/turns_mean"] >= 1
        assert row["rollout/generated_tokens"] > 0 and "rollout/status/failed" not in row
        assert 0 <= row["rollout/text_drift_samples"] <= 8
    assert sum(r["rollout/text_drift_tokens"] for r in rows) > 0  # the observation glued to the model's last word
    assert any(r["train/grad_norm"] > 0 for r in rows)


@pytest.mark.slow
def test_a_vlm_multi_turn_rollout_with_an_env_module_trains_step_wise_on_rebuilt_turns(tmp_path, data, tiny_paths):
    run = tmp_path / "run"
    proc = train(
        tiny_paths["qwen2.5-vl"],
        run,
        *("--prompt-data", str(data / "figures.jsonl"), "--input-key", "messages"),
        *("--multimodal-keys", '{"image": "images"}', "--rollout-max-response-len", "24"),
        *("--custom-generate-function-path", "vlm_rollout.generate", "--rollout-interaction-env-path", "vlm_env.py"),
        *("--max-turns", "2", "--rm-type", "random", "--sample-format", "step_wise"),
        *("--rollout-batch-size", "1", "--global-batch-size", "4"),
    )
    assert DRIFT_WARNING not in proc.stderr  # token ids in, no drift
    rows = rows_of(run)
    returned = [json.loads(line) for line in (run / "returned.jsonl").read_text().splitlines()]
    assert len(returned) == 8 and any(r["images"] == 2 for r in returned)  # turn 2 saw the env's second figure
    for row in rows:
        turns = row["rollout/turns_mean"] * 4
        assert row["rollout/samples_with_rebuilt_turns"] == 4 and row["train/sequences_before_merge"] == turns
        assert "rollout/status/failed" not in row and "rollout/text_drift_tokens" not in row
    assert any(r["train/grad_norm"] > 0 for r in rows)


@pytest.mark.slow
def test_a_rollout_function_returning_rollout_fn_train_output_trains_and_logs_its_metrics(tmp_path, data, tiny_paths):
    run = tmp_path / "run"
    proc = train(
        tiny_paths["qwen2"],
        run,
        *("--prompt-data", str(data / "search.jsonl"), "--rollout-max-response-len", "24"),
        *("--rollout-function-path", "rollout_fn.generate_rollout"),
        *("--custom-generate-function-path", "rollout_fn.generate", "--rm-type", "random"),
        *("--sample-format", "step_wise", "--rollout-batch-size", "1", "--global-batch-size", "4"),
    )
    assert DRIFT_WARNING not in proc.stderr
    for row in rows_of(run):
        assert row["custom/response_length_max"] >= 1
        assert row["rollout/samples_with_rebuilt_turns"] == 4 and row["train/sequences_before_merge"] == 4
        assert "rollout/status/failed" not in row


def test_a_slime_plugin_without_the_flag_is_caught_before_the_run_with_the_hint(tmp_path, data, tiny_paths):
    """``--dry-run`` imports every plug-in: without ``--slime-compat`` the error names the flag; with it
    the same command passes."""
    cmd = [
        *(sys.executable, "-m", "slime_mt.cli", "train", "--dry-run", "--hf-checkpoint", str(tiny_paths["qwen2"])),
        *("--prompt-data", str(data / "search.jsonl"), "--custom-generate-function-path", "search_generate.generate"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=PLUGINS, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "slime-mt train: error: PluginError: --custom-generate-function-path: plug-in module 'search_generate' "
        "raised while importing: ModuleNotFoundError: No module named 'slime' (a plug-in written against slime's "
        "API: add --slime-compat)"
    )
    proc = subprocess.run([*cmd, "--slime-compat"], capture_output=True, text=True, timeout=120, cwd=PLUGINS, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "# dry run: plug-ins: imported and checked" in proc.stdout
