"""The Megatron worlds of the backend tests (``megatron_worlds.WORLDS``), through one session fixture:
``world(name)`` is the results of world ``name``, launched the first time a test asks for it in this
session and read by every test after (megatron is imported once per launch, not per test or module);
``world(name, kind)`` the launch of ``name`` whose checks ran family ``kind`` (the MoE families have their
own). A launch's time is counted as a shared set-up (``world NAME``), not as the asking test's.
``megatron_dir`` holds what the worlds write (results, the TP matrix, the DP runs, the resharded
checkpoints)."""

import pytest
from megatron_worlds import launch_world, world_name

# a world that reads what another saved is launched after it: TP=2's reshard_load reads the checkpoint
# TP=1 saved, DP=2's the one TP=2 saved again, EP=1's resume the one EP=2 saved, the PP worlds TP=1's, and
# TP=2 with SP and PP=2 the LoRA checkpoints EP=1's saved
AFTER = {
    "tp2": ("tp1",),
    "dp2": ("tp2",),
    "ep1_resume": ("ep2",),
    "pp2": ("tp1", "ep1_resume"),
    "tp2pp2sp": ("tp1",),
    "tp2sp": ("ep1_resume",),
}


@pytest.fixture(scope="session")
def megatron_dir(session_dir):
    return session_dir("megatron")


@pytest.fixture(scope="session")
def world(request, megatron_dir):
    """``world(name[, kind])`` -> that world's results (a launch that failed fails every test asking)."""
    clock = request.config._setup_clock
    launched: dict[str, dict | Exception] = {}

    def results(name: str, kind: str | None = None) -> dict:
        name = world_name(name, kind) if kind else name
        if name not in launched:
            for before in AFTER.get(name, ()):
                results(before)
            with clock.shared_set_up(f"world {name} (session, tests/integration/backends)"):
                try:
                    launched[name] = launch_world(name, megatron_dir)
                except Exception as e:  # noqa: BLE001 - kept, and raised to every test that asks
                    launched[name] = e
        if isinstance(launched[name], Exception):
            raise launched[name]
        return launched[name]

    return results
