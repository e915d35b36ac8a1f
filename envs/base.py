"""The interaction-environment API, where environment modules take it from: ``from envs.base import
BaseInteractionEnv``. Its contract and its definitions: ``slime_mt/environment.py``."""

from slime_mt.environment import BaseInteractionEnv, build_env, opening_of, opening_text
from slime_mt.errors import InvalidActionError, RecoverableEnvError, RetryableEnvError

__all__ = [
    "BaseInteractionEnv",
    "InvalidActionError",
    "RecoverableEnvError",
    "RetryableEnvError",
    "build_env",
    "opening_of",
    "opening_text",
]
