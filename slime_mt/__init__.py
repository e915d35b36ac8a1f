"""slime_mt: multi-turn reinforcement learning for LLMs and VLMs on Megatron-core, slime style."""

__version__ = "0.1.0"
