"""The Megatron worlds of the backend tests (``megatron_worlds.WORLDS``): each launched once per pytest
session, when a test first reads it, and read by every module that needs it (megatron is imported once
per launch, not per test or module). ``megatron_dir`` holds what the worlds write (results, the TP
matrix, the DP runs, the resharded checkpoints)."""

import pytest
from megatron_worlds import launch_world


@pytest.fixture(scope="session")
def megatron_dir(session_dir):
    return session_dir("megatron")


@pytest.fixture(scope="session")
def megatron_tp1(megatron_dir):
    return launch_world("tp1", megatron_dir)


@pytest.fixture(scope="session")
def megatron_tp1_models(megatron_dir):
    return launch_world("tp1_models", megatron_dir)


@pytest.fixture(scope="session")
def megatron_tp2(megatron_dir, megatron_tp1):
    """TP=2 (its reshard_load reads the checkpoint the TP=1 world saved)."""
    return launch_world("tp2", megatron_dir)


@pytest.fixture(scope="session")
def megatron_dp2(megatron_dir, megatron_tp2):
    """TP=1 x DP=2 (its reshard_load reads the checkpoint the TP=2 world saved again)."""
    return launch_world("dp2", megatron_dir)


@pytest.fixture(scope="session")
def megatron_tp2dp2(megatron_dir):
    return launch_world("tp2dp2", megatron_dir)
