"""Template drift guard: which tokenization path is exact for a chat template.

Each scenario is a conversation (prompt, then turns of model output and observations) with known
generated ids (the tokenization of each answer, plus the end-of-turn token when the model ended its
turn; a stop-string turn has none). For every turn ``k`` the template's own context is
``R_k`` = the tokenized render of the history before turn ``k`` with the generation prompt. A path is
exact when the contexts it gives the model are the template's and it trains only what was generated:

  append          the fixed-base delta contexts (token-in/token-out) equal R_k at every turn
  strip_thinking  the ``strip_thinking`` contexts (context_policy.py) equal R_k at every turn
  step-wise       always: every step trains the context that was sent, whatever it is
  retokenize      re-rendering is prefix-stable: R_{k+1} starts with R_k followed by turn k's
                  generated ids, so re-tokenized history never changes a token the model saw or made

When a path is not exact the line names the turn and the first differing token, with both decodings.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from slime_mt.rollout.context_policy import append, kept_outputs, strip_thinking
from slime_mt.tokenization import ObservationEncoder

logger = logging.getLogger(__name__)

PATHS = ("append", "strip_thinking", "step-wise", "retokenize")
CALCULATOR = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


@dataclass
class Scenario:
    """A conversation: prompt messages, then per turn (answer text, ended with end-of-turn, observations)."""

    name: str
    prompt: list[dict]
    turns: list[tuple[str, bool, list[dict]]]
    tools: bool = False
    images: bool = False


def _diagram(seed: int):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (64 + 16 * seed, 48), (30 * seed % 256, 120, 200))
    ImageDraw.Draw(image).rectangle([6, 6, 30 + 4 * seed, 30], outline=(255, 255, 255), width=2)
    return image


def _call(expression: str) -> str:
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'


def scenarios() -> list[Scenario]:
    """The conformance scenarios (the images one runs only for models with an image processor)."""
    think = "<think>\n{}\n</think>\n\n{}"
    return [
        Scenario(
            "tools",
            [{"role": "user", "content": "What is 17 * 23 + 4? Use the calculator."}],
            [
                (_call("17 * 23"), True, [{"role": "tool", "content": "391"}]),
                (_call("391 + 4"), True, [{"role": "tool", "content": "395"}]),
                ("17 * 23 + 4 = 395.", True, []),
            ],
            tools=True,
        ),
        Scenario(
            "system+tools",
            [
                {"role": "system", "content": "You are a careful solver."},
                {"role": "user", "content": "What is 2 ** 10?"},
            ],
            [(_call("2 ** 10"), True, [{"role": "tool", "content": "1024"}]), ("2 ** 10 = 1024.", True, [])],
            tools=True,
        ),
        Scenario(
            "thinking",
            [{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": "Name a color."}],
            [
                (think.format("The user wants a color.", "Blue."), True, [{"role": "user", "content": "Another one?"}]),
                (think.format("A different one.", "Green."), True, [{"role": "user", "content": "And a third?"}]),
                (think.format("One more.", "Red."), True, []),
            ],
        ),
        Scenario(
            "tools+thinking",
            [{"role": "user", "content": "What is 12 * 12? Use the calculator."}],
            [
                (
                    think.format("I should call the calculator.", _call("12 * 12")),
                    True,
                    [{"role": "tool", "content": "144"}],
                ),
                (think.format("The tool said 144.", "12 * 12 = 144."), True, []),
            ],
            tools=True,
        ),
        Scenario(
            "stop_string",
            [{"role": "user", "content": "Say a number, then STOP."}],
            [("Seven STOP", False, [{"role": "user", "content": "Are you sure?"}]), ("Yes.", True, [])],
        ),
        Scenario(
            "images",
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": _diagram(1)},
                        {"type": "text", "text": "What shape is this?"},
                    ],
                }
            ],
            [
                (
                    "A rectangle.",
                    True,
                    [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image", "image": _diagram(2)},
                                {"type": "text", "text": "And this one?"},
                            ],
                        }
                    ],
                ),
                ("A wider rectangle.", True, []),
            ],
            images=True,
        ),
    ]


@dataclass
class PathResult:
    exact: bool
    detail: str


@dataclass
class ScenarioResult:
    scenario: str
    paths: dict[str, PathResult] = field(default_factory=dict)

    @property
    def exact_paths(self) -> list[str]:
        return [p for p in PATHS if self.paths[p].exact]


def _first_difference(tokenizer, got: list[int], want: list[int], turn: int) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    show = lambda ids: repr(tokenizer.decode(ids[at : at + 6])) if at < len(ids) else "(end)"  # noqa: E731
    return (
        f"turn {turn}, token {at}: path {show(got)} {got[at : at + 1] or ''} vs template {show(want)} "
        f"{want[at : at + 1] or ''}"
    )


def check_scenario(processor: Any, scenario: Scenario, tools: list[dict] | None) -> ScenarioResult:
    encoder = ObservationEncoder(processor, tools=tools if scenario.tools else None)
    tokenizer = encoder.tokenizer
    generated = []
    for text, ended, _ in scenario.turns:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        generated.append(ids + [encoder.eot_id] if ended else ids)
    turns: list[list[dict]] = []
    append_ctx = encoder.encode_prompt(scenario.prompt).ids
    renders, appends, strips = [], [], []
    for k, (text, ended, observations) in enumerate(scenario.turns):
        history = append(None, None, scenario.prompt, turns)
        stripped = strip_thinking(None, None, scenario.prompt, turns)
        renders.append(encoder.encode_context(history, {}).ids)
        appends.append(list(append_ctx))
        # as the rollout does: an unchanged conversation is sent token-in/token-out
        strips.append(
            list(append_ctx)
            if stripped == history
            else encoder.encode_context(stripped, kept_outputs(stripped, turns, generated)).ids
        )
        if not observations:
            break
        turns.append([{"role": "assistant", "content": text}, *observations])
        append_ctx += generated[k] + encoder.encode_observation(observations, ended).ids
    result = ScenarioResult(scenario.name)
    for path, contexts in (("append", appends), ("strip_thinking", strips)):
        bad = next((k for k, (got, want) in enumerate(zip(contexts, renders)) if got != want), None)
        result.paths[path] = (
            PathResult(True, "contexts == template render")
            if bad is None
            else PathResult(False, _first_difference(tokenizer, contexts[bad], renders[bad], bad))
        )
    result.paths["step-wise"] = PathResult(True, "each step trains the context sent")
    result.paths["retokenize"] = PathResult(True, "re-render is prefix-stable")
    for k in range(len(renders) - 1):
        want = renders[k] + generated[k]
        if renders[k + 1][: len(want)] != want:
            result.paths["retokenize"] = PathResult(
                False, "not prefix-stable: " + _first_difference(tokenizer, renders[k + 1][: len(want)], want, k + 1)
            )
            break
    return result


def check_template(processor: Any, tools: list[dict] | None = None) -> list[ScenarioResult]:
    """Every scenario that applies to this model (images only with an image processor)."""
    has_images = getattr(processor, "image_token", None) is not None
    out = []
    for scenario in scenarios():
        if scenario.images and not has_images:
            continue
        try:
            out.append(check_scenario(processor, scenario, tools or CALCULATOR))
        except Exception as e:  # a template may refuse a scenario's messages (jinja errors, raise_exception)
            failed = ScenarioResult(scenario.name)
            failed.paths = {
                p: PathResult(
                    p == "step-wise",
                    "each step trains the context sent"
                    if p == "step-wise"
                    else f"template cannot render the scenario: {e}",
                )
                for p in PATHS
            }
            out.append(failed)
    return out


def verdict(results: list[ScenarioResult]) -> list[str]:
    """The paths exact in every scenario."""
    return [p for p in PATHS if all(r.paths[p].exact for r in results)]


def report(results: list[ScenarioResult]) -> str:
    lines = [
        f"{r.scenario:<15} {path:<15} {'exact  ' if res.exact else 'INEXACT'} {res.detail}"
        for r in results
        for path, res in r.paths.items()
    ]
    exact = verdict(results)
    lines.append(
        f"verdict: exact for this template: {', '.join(exact)}; not exact: "
        f"{', '.join(p for p in PATHS if p not in exact) or 'none'}"
    )
    return "\n".join(lines)


def path_of(
    context_policy: str, context_policy_path: str | None, retokenize: bool = False, single_message: bool = False
) -> str | None:
    """The check's path for a rollout configuration. None: nothing to check (one assistant message
    appends raw tokens, no template between turns) or a user policy, which the check cannot know."""
    if single_message:
        return None
    if retokenize:
        return "retokenize"
    if context_policy_path:
        return None
    return {"append": "append", "strip_thinking": "strip_thinking"}.get(context_policy.partition(":")[0], "step-wise")


def warn_if_inexact(processor: Any, path: str | None, tools: list[dict] | None = None) -> list[ScenarioResult]:
    """The rollout-start check: log a warning naming the scenarios where the chosen path is not exact."""
    if path is None:
        return []
    results = check_template(processor, tools)
    bad = [r for r in results if not r.paths[path].exact]
    for r in bad:
        logger.warning(
            "template check: the %s path is not exact for this chat template in scenario %r: %s "
            "(run `slime-mt check-template` for every path)",
            path,
            r.scenario,
            r.paths[path].detail,
        )
    return results


def load_tools(path: str | None) -> list[dict] | None:
    if not path:
        return None
    try:
        with open(path) as f:
            tools = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--tools {path}: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"--tools {path}: expected a JSON list of tool schemas")
    return tools
