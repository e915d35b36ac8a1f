"""Training backends: Megatron-core in ``megatron/``."""
