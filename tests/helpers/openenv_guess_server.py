"""An OpenEnv server for the tests of envs/openenv.py, written on openenv-core (run with .venv-openenv's
python): a number-guessing game, one game per WebSocket session.

    python tests/openenv_guess_server.py PORT

reset(seed) draws the number (1..100) from the seed and says so; each step takes a guess in the
action's one string field ``message`` and answers higher, lower or correct (reward 1, done), a
non-number is told so with the guess's count (reward 0); after 6 guesses the game is over (done,
reward 0)."""

import random
import sys

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app

MAX_GUESSES = 6


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.target = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self.target = random.Random(seed).randint(1, 100)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=f"Game {seed}: guess my number between 1 and 100.", reward=None)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if self.target is None:
            raise RuntimeError("step before reset")
        self._state.step_count += 1
        over = self._state.step_count >= MAX_GUESSES
        words = action.message.split()
        guess = next((int(w.strip(".,!")) for w in words if w.strip(".,!").isdigit()), None)
        if guess is None:
            message = f"That is not a number (guess {self._state.step_count} of {MAX_GUESSES})."
            return GuessObservation(prompt=message, reward=0.0, done=over)
        if guess == self.target:
            return GuessObservation(prompt=f"{guess} is correct!", reward=1.0, done=True)
        hint = "higher" if guess < self.target else "lower"
        return GuessObservation(prompt=f"{guess}? Go {hint}.", reward=0.0, done=over)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
