"""The Megatron worlds of the backend tests (``megatron_worlds.WORLDS``): each launched once per pytest
session, when a test first reads it, and read by every module that needs it (megatron is imported once
per launch, not per test or module). ``megatron_dir`` holds what the worlds write (results, the TP
matrix, the DP runs, the resharded checkpoints). Each world is the session fixture ``megatron_NAME``."""

import pytest
from megatron_worlds import WORLDS, launch_world, world_name

# a world that reads what another saved is launched after it: TP=2's reshard_load reads the checkpoint
# TP=1 saved, DP=2's the one TP=2 saved again, EP=1's resume the one EP=2 saved, and the PP worlds TP=1's
AFTER = {"tp2": "tp1", "dp2": "tp2", "ep1_resume": "ep2", "pp2": "tp1", "tp2pp2sp": "tp1"}


@pytest.fixture(scope="session")
def megatron_dir(session_dir):
    return session_dir("megatron")


def _world(name: str):
    def launched(request, megatron_dir):
        if name in AFTER:
            request.getfixturevalue(f"megatron_{AFTER[name]}")
        return launch_world(name, megatron_dir)

    launched.__doc__ = f"The results of the {name!r} world (megatron_worlds.WORLDS)."
    return pytest.fixture(scope="session", name=f"megatron_{name}")(launched)


for _name in WORLDS:
    globals()[f"_megatron_{_name}"] = _world(_name)


@pytest.fixture
def world_of(request):
    """``world_of(name, kind)``: the results of the launch whose ``name`` checks ran family ``kind``."""
    return lambda name, kind: request.getfixturevalue(f"megatron_{world_name(name, kind)}")
