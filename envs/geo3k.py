"""geo3k multi-turn environment: geometry questions about a diagram, with a ``calc_score`` tool.

The model may call ``<tool_call>{"name": "calc_score", "arguments": {"answer": "..."}}</tool_call>``;
the tool's verdict comes back as the next observation (role ``tool``), up to ``--max-turns``. The
episode ends when the model gives a final answer in ``\\boxed{...}``. The training reward is the
grade of that final boxed answer (``math-verify``'s equivalence, or equal values within geo3k's
rounding); the tool's feedback is not the reward unless the custom setting ``geo3k_tool_reward: true``
is given.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import operator
import re

from envs.base import BaseInteractionEnv

logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": the env step's applies

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def _eval(node) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sqrt"
        and len(node.args) == 1
    ):
        return math.sqrt(_eval(node.args[0]))
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    raise ValueError(f"unsupported expression node {type(node).__name__}")


def to_number(answer: str) -> float | None:
    """A LaTeX-ish answer (``3\\sqrt{2}``, ``\\frac{7}{2}``, ``12\\pi``, ``45^\\circ``, ``2.5``) -> float."""
    if answer is None:
        return None
    s = str(answer).strip().strip("$").replace("\\left", "").replace("\\right", "").replace("\\!", "")
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\degree", "", s)
    s = re.sub(r"\\(d|t)?frac\{([^{}]*)\}\{([^{}]*)\}", r"((\2)/(\3))", s)
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = re.sub(r"\\sqrt\s*(\d+(?:\.\d+)?)", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("π", "pi").replace("\\cdot", "*").replace("\\times", "*")
    s = s.replace("{", "(").replace("}", ")").replace("^", "**").replace(",", "")
    s = re.sub(r"\\[a-zA-Z]+", "", s)
    s = re.sub(r"(\d|\))\s*(sqrt|pi|\()", r"\1*\2", s)  # implicit products: 2sqrt(3), 3pi, 2(…)
    s = re.sub(r"(pi|\))\s*(\d)", r"\1*\2", s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s.strip())
    try:
        return _eval(ast.parse(s, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None


def _parsed(answer: str) -> list:
    from math_verify import parse

    text = str(answer).strip()
    return parse(text if text.startswith("$") else f"${text}$", parsing_timeout=None)


def _numeric(parsed: list) -> float | None:
    """The value of a math-verify parse (``x = 8`` -> 8), or None when it is not one real number."""
    import sympy

    for value in parsed:
        if isinstance(value, sympy.Equality):
            value = value.rhs
        if isinstance(value, sympy.Expr) and not value.free_symbols:
            try:
                number = complex(value.evalf())
            except (TypeError, ValueError):
                continue
            if number.imag == 0 and math.isfinite(number.real):
                return number.real
    return None


def grade(candidate: str | None, reference: str, rel_tol: float = 1e-3) -> float:
    """1.0 when the candidate equals the reference, else 0.0. Both are read by ``math-verify``: equal
    when it verifies them (symbolically: ``\\sqrt[3]{27}`` = 3, ``8 \\text{ cm}`` = 8), else when their
    values agree within 0.1% or 0.01 (geo3k's labels are rounded: ``3\\sqrt{2}`` = 4.24); what it
    cannot read is evaluated by ``to_number``, and non-numeric answers compare as normalised strings."""
    from math_verify import verify

    if candidate is None:
        return 0.0
    gold, predicted = _parsed(reference), _parsed(candidate)
    if gold and predicted:
        if verify(gold, predicted, timeout_seconds=None):
            return 1.0
        a, b = _numeric(predicted), _numeric(gold)
        if a is not None and b is not None:
            return float(math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-2))
    a, b = to_number(candidate), to_number(reference)
    if a is not None and b is not None:
        return float(math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-2))
    norm = lambda x: re.sub(r"\s+|\\,|\$", "", str(x)).lower()  # noqa: E731
    return float(norm(candidate) == norm(reference))


class Geo3kEnv(BaseInteractionEnv):
    observation_role = "tool"

    def __init__(self, answer: str, tool_reward: bool = False):
        self.answer = str(answer)
        self.tool_reward = tool_reward
        self.tool_calls = 0
        self.best_tool_score = 0.0

    def step(self, response_text: str):
        boxed = last_boxed(response_text)
        if boxed is not None:
            score = grade(boxed, self.answer)
            reward = max(score, self.best_tool_score) if self.tool_reward else score
            return {"text": ""}, True, {"reward": reward, "final_correct": score, "tool_calls": self.tool_calls}
        call = _TOOL_CALL.search(response_text)
        if call:
            self.tool_calls += 1
            try:
                payload = json.loads(call.group(1))
                candidate = str(payload["arguments"]["answer"])
                if payload.get("name") != "calc_score":
                    raise KeyError(payload.get("name"))
            except (json.JSONDecodeError, KeyError, TypeError):
                return (
                    {"text": 'Invalid tool call. Use {"name": "calc_score", "arguments": {"answer": "..."}}.'},
                    False,
                    {"reward": 0.0},
                )
            score = grade(candidate, self.answer)
            self.best_tool_score = max(self.best_tool_score, score)
            verdict = "correct" if score else "incorrect"
            return (
                {"text": f"calc_score: the answer {candidate} is {verdict}."},
                False,
                {"reward": self.best_tool_score if self.tool_reward else 0.0, "tool_score": score},
            )
        return (
            {"text": "Please check an answer with calc_score or give the final answer as \\boxed{...}."},
            False,
            {"reward": 0.0},
        )


def build_env(sample=None, args=None, **kw) -> Geo3kEnv:
    tool_reward = bool(getattr(args, "geo3k_tool_reward", False)) if args is not None else False
    return Geo3kEnv(sample.label, tool_reward=tool_reward)
