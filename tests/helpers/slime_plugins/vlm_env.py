"""The environment module of the VLM rollout (slime's ``build_env(sample, args)`` contract): the first
step answers with a second figure, the next one ends the episode."""

from PIL import Image


class BaseInteractionEnv:
    def reset(self):
        return {}, {}

    def step(self, response_text: str):
        raise NotImplementedError

    def format_observation(self, observation: dict) -> dict:
        raise NotImplementedError

    def close(self):
        pass


class FigureEnv(BaseInteractionEnv):
    def __init__(self, max_turns: int):
        self.max_turns = max_turns
        self.turn = 0

    def step(self, response_text: str):
        self.turn += 1
        if self.turn >= self.max_turns:
            return {}, True, {}
        figure = Image.new("RGB", (64, 64), (40 * self.turn, 120, 200))
        return {"obs_str": "Here is the figure from another angle.", "image": figure}, False, {}

    def format_observation(self, observation: dict) -> dict:
        content = [{"type": "image", "image": observation["image"]}, {"type": "text", "text": observation["obs_str"]}]
        return {"role": "user", "content": content}


def build_env(sample=None, args=None, **kwargs):
    return FigureEnv(max_turns=args.max_turns)
