"""The CPU demo's task: two-digit addition with a second try after feedback.

The model answers "What is a + b?"; the env reads the last number of the reply. Correct on the first
try: reward 1.0. Otherwise the env says the answer is wrong and asks for another try (one feedback
turn): correct then gives 0.5. The prompt asks for the answer in the form "Answer: N".
"""

import re

from envs.base import BaseInteractionEnv


class AdditionEnv(BaseInteractionEnv):
    def __init__(self, target: int):
        self.target = target
        self.turns = 0

    def step(self, response_text):
        self.turns += 1
        match = re.findall(r"-?\d+", response_text)
        correct = bool(match) and int(match[0]) == self.target
        if correct:
            return {"text": ""}, True, {"reward": 1.0 if self.turns == 1 else 0.5, "correct": 1}
        hint = "That is wrong." if match else "Please answer with a number."
        return {"text": f"{hint} Try again."}, False, {"reward": 0.0, "correct": 0}


def build_env(sample=None, args=None, **kw):
    return AdditionEnv(int(sample.label))
