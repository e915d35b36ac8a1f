"""The CPU demo's secret-word game with a hint turn, so that a window over the last turn drops one.

Turn 1: a guess; a wrong one gets the word's first letter. Turn 2: a guess; a wrong one gets the
word and a request for it alone. Turn 3: the reply scores 1 / (1 + 0.25 * extra words) when it
contains the word, else 0. A guess that is exactly the word ends the game with reward 1 at any turn.
Under ``--context-policy window:1`` the third call sees the prompt and the second turn only (the
reveal), not the first guess and its hint: the turn records that context, and step-wise training
trains exactly it.
"""

import re

from envs.base import BaseInteractionEnv


class HintedSecretEnv(BaseInteractionEnv):
    def __init__(self, secret: str):
        self.secret = secret.lower()
        self.turns = 0

    def step(self, response_text):
        self.turns += 1
        words = re.findall(r"[a-z]+", response_text.lower())
        if words == [self.secret]:
            return {"text": ""}, True, {"reward": 1.0}
        if self.turns == 1:
            return {"text": f"No. Hint: it starts with '{self.secret[0]}'. Guess again, one word."}, False, {}
        if self.turns == 2:
            return {"text": f"No. The secret word is '{self.secret}'. Now reply with only the secret word."}, False, {}
        return {"text": ""}, True, {"reward": 1.0 / (1.0 + 0.25 * (len(words) - 1)) if self.secret in words else 0.0}


def build_env(sample=None, args=None, **kw):
    return HintedSecretEnv(str(sample.label))
