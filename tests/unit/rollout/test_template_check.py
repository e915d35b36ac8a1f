"""The template drift guard: verdicts per model, a deliberately broken template, the CLI, the
rollout-start warning, and the bundled Qwen3 template against Qwen3's official one."""

import logging

import pytest
from transformers import AutoTokenizer

from slime_mt.assets import qwen3_reference_tokenizer_dir, qwen_tokenizer_dir, smollm2_dir, tiny_model_dir
from slime_mt.assets.chat_templates import QWEN25
from slime_mt.cli import main
from slime_mt.processing import load_tokenizer_or_processor
from slime_mt.rollout.template_check import CALCULATOR, check_template, scenarios, verdict, warn_if_inexact

ALL = {"append", "strip_thinking", "step-wise", "retokenize"}
NO_STRIP = {"append", "step-wise", "retokenize"}
# Qwen3 keeps the thinking of turns after the last user query (tool loops) and drops it before it
QWEN3_SCENARIOS = {
    "tools": ALL,
    "system+tools": ALL,
    "thinking": {"strip_thinking", "step-wise"},
    "tools+thinking": NO_STRIP,
    "stop_string": ALL,
    "images": ALL,
}
PLAIN_SCENARIOS = {
    "tools": ALL,
    "system+tools": ALL,
    "thinking": NO_STRIP,
    "tools+thinking": NO_STRIP,
    "stop_string": ALL,
    "images": ALL,
}


def model_dir(name):
    return {
        "smollm2": smollm2_dir,
        "qwen3": qwen3_reference_tokenizer_dir,
        "qwen2.5": lambda: qwen_tokenizer_dir("qwen2.5"),
    }.get(name, lambda: tiny_model_dir(name))()


@pytest.mark.parametrize(
    "name,per_scenario,overall",
    [
        ("smollm2", PLAIN_SCENARIOS, NO_STRIP),
        ("qwen2.5", PLAIN_SCENARIOS, NO_STRIP),
        ("qwen3", QWEN3_SCENARIOS, {"step-wise"}),
        ("qwen2.5-vl", PLAIN_SCENARIOS, NO_STRIP),
        ("qwen3-vl", QWEN3_SCENARIOS, {"step-wise"}),
    ],
)
def test_verdicts(name, per_scenario, overall):
    processor = load_tokenizer_or_processor(model_dir(name))
    results = check_template(processor)
    assert [r.scenario for r in results] == [s.name for s in scenarios() if name.endswith("-vl") or not s.images]
    for r in results:
        assert set(r.exact_paths) == per_scenario[r.scenario], (r.scenario, r.paths)
    assert set(verdict(results)) == overall


def test_a_template_that_drops_the_newline_after_end_of_turn_on_re_render():
    """Messages before the last lose the newline after <|im_end|>: the render at turn k ends
    "<|im_end|>\\n<|im_start|>assistant" but at turn k+1 the same place reads "<|im_end|><|im_start|>"."""
    line = "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}"
    assert line in QWEN25
    broken = QWEN25.replace(line, line.replace("'<|im_end|>\\n'", "'<|im_end|>' + ('\\n' if loop.last else '')"))
    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir("qwen2.5")))
    tokenizer.chat_template = broken
    results = check_template(tokenizer)
    assert verdict(results) == ["step-wise"]
    tools = next(r for r in results if r.scenario == "tools")
    assert "turn 1" in tools.paths["append"].detail and "'\\n<|im_start|>assistant" in tools.paths["append"].detail
    assert tools.paths["retokenize"].detail.startswith("not prefix-stable: turn 1")


def test_the_cli_prints_a_line_per_scenario_and_path_and_the_verdict(capsys, tmp_path):
    (tmp_path / "tools.json").write_text('[{"type": "function", "function": {"name": "search", "parameters": {}}}]')
    assert (
        main(
            [
                "check-template",
                "--hf-checkpoint",
                str(qwen3_reference_tokenizer_dir()),
                "--tools",
                str(tmp_path / "tools.json"),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 * 4 + 1
    assert lines[0].split()[:3] == ["tools", "append", "exact"]
    assert any(line.split()[:3] == ["thinking", "append", "INEXACT"] and "'<think>" in line for line in lines)
    assert lines[-1] == "verdict: exact for this template: step-wise; not exact: append, strip_thinking, retokenize"
    (tmp_path / "bad.json").write_text('{"not": "a list"}')
    assert main(["check-template", "--hf-checkpoint", str(smollm2_dir()), "--tools", str(tmp_path / "bad.json")]) == 2
    assert "--tools" in capsys.readouterr().err
    assert main(["check-template", "--hf-checkpoint", str(tmp_path / "missing")]) == 2


def test_the_rollout_start_check_warns_when_the_chosen_path_is_not_exact(caplog):
    processor = load_tokenizer_or_processor(qwen3_reference_tokenizer_dir())
    with caplog.at_level(logging.WARNING, logger="slime_mt.rollout.template_check"):
        warn_if_inexact(processor, "append")
    assert [r.message.split("scenario ")[1].split(":")[0] for r in caplog.records] == ["'thinking'"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slime_mt.rollout.template_check"):
        warn_if_inexact(load_tokenizer_or_processor(smollm2_dir()), "append")
    assert caplog.records == []


def conversations():
    """Every prefix of every text scenario, as rendered at generation time and as history."""
    for scenario in scenarios():
        if scenario.images:
            continue
        messages = list(scenario.prompt)
        yield scenario, list(messages), True
        for text, _, observations in scenario.turns:
            messages += [{"role": "assistant", "content": text}]
            yield scenario, list(messages), False
            messages += observations
            if observations:
                yield scenario, list(messages), True


def test_the_bundled_qwen3_template_is_the_official_one_byte_for_byte():
    official = AutoTokenizer.from_pretrained(str(qwen3_reference_tokenizer_dir()))
    bundled = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir("qwen3")))
    checked = 0
    for scenario, messages, generation in conversations():
        for extra in ({}, {"enable_thinking": False}):
            kw = dict(
                tools=CALCULATOR if scenario.tools else None, tokenize=False, add_generation_prompt=generation, **extra
            )
            assert bundled.apply_chat_template(messages, **kw) == official.apply_chat_template(messages, **kw), (
                scenario.name,
                len(messages),
                extra,
            )
            checked += 1
    assert checked >= 40
