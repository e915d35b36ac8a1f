"""The interaction-environment API (``--rollout-interaction-env-path``). Environments import it from
``envs.base``, which hands these names on.

An environment module defines ``build_env(sample=None, args=None, **kw) -> BaseInteractionEnv``; the
rollout builds one env per trajectory, calls ``reset()`` once (an observation it returns, a dict like
``step``'s, a string, or slime's ``(observation, reset_info)``, follows the row's prompt as part of the
prompt: a game's board, a task the env draws; an empty one is none), then after every model turn calls
``step(response_text)`` and appends ``format_observation(observation)`` to the conversation (its tokens
get loss mask 0: the model is never trained on them). ``close()`` is always called, also after errors.

A minimal environment::

    from envs.base import BaseInteractionEnv

    class Guess(BaseInteractionEnv):
        def __init__(self, target):
            self.target = target

        def step(self, response_text):
            guess = int(response_text.strip()) if response_text.strip().isdigit() else None
            if guess == self.target:
                return {"text": "Correct!"}, True, {"reward": 1.0}
            hint = "higher" if guess is None or guess < self.target else "lower"
            return {"text": f"Try {hint}."}, False, {}

    def build_env(sample=None, args=None, **kw):
        return Guess(int(sample.label))

Contract of ``step``:
  * returns ``(observation: dict, done: bool, info: dict)``; may be ``async def``.
  * ``observation`` holds ``text`` and optionally ``images`` (PIL images, file paths, base64 or data
    URIs); ``format_observation`` turns it into one chat message or a list of them.
  * ``info`` may carry ``reward``: kept on the turn (``Turn.reward``, which reward functions read);
    the last one reported is the trajectory's reward when no ``--custom-rm-path`` is given (a reward
    function may combine the turns', e.g. ``slime_mt.rollout.rewards.turn_rewards_sum``). Any other
    numbers are metrics, kept on the turn record; ``retryable: True`` asks for the step to be retried.
  * an action that cannot be acted on (unparseable, an unknown tool) raises
    ``InvalidActionError(feedback)`` or sets ``info["invalid_action"] = True``: the feedback is the
    observation, the turn does not count toward ``--max-turns``, and past
    ``--max-invalid-actions-per-turn`` such turns in a row the sample ends TRUNCATED
    (``invalid_actions``). Invalid turns stay in the trajectory and are trained as generated.
  * a transient fault raises ``RetryableEnvError`` (or takes longer than ``--env-step-timeout``):
    the same step is retried up to ``--max-env-retries-per-turn`` times;
  * a fault that loses the env's state (a sandbox or server restarted) raises
    ``RecoverableEnvError``: the env is ``reset()`` and the episode's actions so far are replayed
    (``replayable = False``, or a replay that answers otherwise than before: the episode restarts from
    its prompt), within ``--max-env-resets`` per sample; a failing ``reset()`` is retried the same way;
  * past a budget, or on any other exception, the sample is FAILED with its cause recorded and left
    out of training and of its group's statistics (never scored as a 0).

An env may declare ``tools`` (OpenAI function schemas) for its sample: they go into the chat template
of the prompt, in place of the row's ``tools``.
"""

from __future__ import annotations

from typing import Any


class BaseInteractionEnv:
    """Base class of interaction environments; override ``step`` (and ``reset``/``close`` if needed)."""

    #: role of observation messages; "tool" renders as <tool_response> in Qwen templates.
    observation_role: str = "user"
    #: OpenAI function schemas for the prompt's chat template (None: the row's ``tools``, if any).
    tools: list[dict] | None = None
    #: whether ``reset()`` then the same actions bring the env back to the same state (see above).
    replayable: bool = True

    def reset(self) -> dict | str | None:
        """Prepare a fresh episode (called once before the first turn) -> None, or the observation that
        opens it (after the row's prompt). May be ``async def``."""

    def step(self, response_text: str) -> tuple[dict, bool, dict]:
        """React to the model's turn -> (observation, done, info). May be ``async def``."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(response_text)")

    def format_observation(self, observation: dict) -> dict | list[dict]:
        """Observation -> chat message(s). Images become ``{"type": "image", "image": ...}`` parts,
        placed before the text, in order."""
        images = list(observation.get("images") or [])
        text = observation.get("text", "")
        if not images:
            return {"role": self.observation_role, "content": text}
        content: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
        if text:
            content.append({"type": "text", "text": text})
        return {"role": self.observation_role, "content": content}

    def close(self) -> None:
        """Release resources (sandboxes, connections); always called."""


def opening_of(returned: Any) -> Any:
    """What ``reset()`` returned, in its accepted forms -> the observation alone: slime's envs return
    ``(observation, reset_info)`` (an empty observation: none), a string is the observation's text."""
    if isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[0], (dict, type(None))):
        returned = returned[0]
    return {"text": returned} if isinstance(returned, str) else returned


def opening_text(opening: Any) -> Any:
    """An opening observation's text (what replays compare): the dict's ``text``, else the value itself."""
    return opening.get("text") if isinstance(opening, dict) else opening


def build_env(sample=None, args=None, **kw) -> BaseInteractionEnv:
    """Prototype of the module-level factory every environment module defines."""
    raise NotImplementedError("an environment module must define build_env(sample=None, args=None, **kw)")
