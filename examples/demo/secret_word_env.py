"""The CPU demo's task: a two-turn secret-word game with feedback.

Turn 1: the model guesses a secret word it cannot know. The env answers with feedback that reveals
the word and asks for it alone. Turn 2: when the reply contains the word, reward 1 / (1 + 0.25 * extra
words) (1.0 for the word alone, 0.5 with five words); 0 otherwise. A correct first guess earns 1.0.
Learning to use the observation, and to answer concisely, moves the mean reward within minutes.
"""

import re

from envs.base import BaseInteractionEnv


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


class SecretWordEnv(BaseInteractionEnv):
    def __init__(self, secret: str):
        self.secret = secret.lower()
        self.turns = 0

    def step(self, response_text):
        self.turns += 1
        words = _words(response_text)
        if words == [self.secret]:
            return {"text": ""}, True, {"reward": 1.0, "exact": 1}
        if self.turns == 1:
            return (
                {"text": f"No. The secret word is '{self.secret}'. Now reply with only the secret word."},
                False,
                {"reward": 0.0, "exact": 0},
            )
        reward = 1.0 / (1.0 + 0.25 * (len(words) - 1)) if self.secret in words else 0.0
        return {"text": ""}, True, {"reward": reward, "exact": 0}


def build_env(sample=None, args=None, **kw):
    return SecretWordEnv(str(sample.label))
