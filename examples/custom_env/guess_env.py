"""A small text environment: guess a secret number with higher/lower feedback.

Use it with ``--rollout-interaction-env-path examples/custom_env/guess_env.py``; each prompt row's
label is the secret. The reward is 1.0 for a correct guess, minus 0.1 per extra turn, 0 otherwise.
"""

import re

from envs.base import BaseInteractionEnv


class GuessEnv(BaseInteractionEnv):
    def __init__(self, secret: int, low: int = 1, high: int = 16):
        self.secret, self.low, self.high = secret, low, high
        self.turns = 0

    def reset(self):
        self.turns = 0

    def step(self, response_text):
        self.turns += 1
        numbers = re.findall(r"-?\d+", response_text)
        if not numbers:
            return (
                {"text": f"Please answer with a number between {self.low} and {self.high}."},
                False,
                {"reward": 0.0, "valid": 0},
            )
        guess = int(numbers[-1])
        if guess == self.secret:
            return {"text": "Correct!"}, True, {"reward": max(1.0 - 0.1 * (self.turns - 1), 0.1), "valid": 1}
        hint = "higher" if guess < self.secret else "lower"
        return {"text": f"{guess} is wrong. The number is {hint}. Guess again."}, False, {"reward": 0.0, "valid": 1}


def build_env(sample=None, args=None, **kw):
    high = getattr(args, "guess_high", 16) if args is not None else 16
    return GuessEnv(int(sample.label), high=high)
