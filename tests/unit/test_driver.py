"""The RL loop (``slime_mt/driver.py``) against fake roles that record their calls: the order of generate,
train, export, push, log and save in each step, with and without --colocate/--offload and --load; a
role that raises stops the run where it raised; a stop request (Ctrl-C, SIGTERM) finishes the step,
saves and returns. The roles are the driver's seams (``roles/train.TrainRole``, ``roles/link``): what
they do is tested with them. Unit tier, well under 1 s."""

import threading

import pytest

from slime_mt.config import Config
from slime_mt.driver import run


class Recorder:
    """The calls both fake roles receive, in order, as (name, argument) pairs."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, name: str, arg=None):
        self.calls.append((name, arg))


class FakeTrainer:
    def __init__(self, record: Recorder, fail_at: int | None = None, stop: threading.Event | None = None):
        self.record, self.fail_at, self.stop = record, fail_at, stop

    def load(self, root):
        self.record("load", root)
        return 2, {"cursor": 2}

    def train(self, step, share):
        self.record("train", step)
        if step == self.fail_at:
            raise RuntimeError(f"a rank died in step {step}")
        if self.stop is not None and step == 1:  # Ctrl-C arrives while step 1 trains
            self.stop.set()
        return {"train/loss": 0.5}, 0.0, 1.0

    def kept_log_probs(self):
        return {}

    def export_weights(self, receive, version):
        self.record("export", version)
        receive(iter(()), version)
        return 0.1

    def save(self, root, step, data_state):
        self.record("save", step)

    def offload(self):
        self.record("offload")
        return 0.0

    def onload(self):
        self.record("onload")

    def trace(self):
        return []


class FakeRollout:
    def __init__(self, record: Recorder, fail_at: int | None = None):
        self.record, self.fail_at = record, fail_at

    def resume(self, step, data_state):
        self.record("resume", step)

    def begin(self, start):
        self.record("begin", start)

    def next_share(self, step):
        self.record("generate", step)
        if step == self.fail_at:
            raise RuntimeError(f"every sample failed in step {step}")
        return f"share {step}"

    def trained(self, step, kept, keep):
        self.record("trained", step)

    def drain(self):
        return 0.0

    def push_weights(self, stream, version):
        self.record("push", version)

    def stop_after(self, requested):
        return requested

    def data_state(self):
        return {"cursor": 0}

    def wake_engines(self):
        self.record("wake")

    def weights_changed(self, version):
        self.record("weights_changed", version)

    def log_step(self, step, times, trace):
        self.record("log", step)


def _config(steps: int = 3, **checkpoint) -> Config:
    cfg = Config()
    cfg.rollout.num_rollout = steps
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return cfg


def _step(k: int, saved: bool = False) -> list[tuple]:
    """One step of the loop without colocation: generate, train, export and push as version k + 1, the
    engines' new version, the log, then the checkpoint when it is due."""
    calls = [("generate", k), ("train", k), ("trained", k), ("export", k + 1), ("push", k + 1)]
    calls += [("weights_changed", k + 1), ("log", k)]
    return calls + ([("save", k + 1)] if saved else [])


def test_each_step_generates_trains_exports_pushes_logs_and_saves_when_due():
    record = Recorder()
    done = run(_config(save="ckpt", save_interval=2), FakeTrainer(record), FakeRollout(record), threading.Event())
    assert done == 3
    assert record.calls == [("begin", 0), *_step(0), *_step(1, saved=True), *_step(2, saved=True)]


def test_colocated_with_offload_saves_then_leaves_the_device_before_the_engines_wake():
    """slime's order under --colocate: the checkpoint, the trainer off the device, the engines' memory
    back; the trainer comes back on the device after the next generation."""
    record = Recorder()
    cfg = _config(steps=2, save="ckpt")
    cfg.cluster.colocate = cfg.cluster.offload = True
    run(cfg, FakeTrainer(record), FakeRollout(record), threading.Event())
    step = lambda k, saved: [  # noqa: E731
        ("generate", k),
        ("onload", None),
        ("train", k),
        ("trained", k),
        ("export", k + 1),
        ("push", k + 1),
        *([("save", k + 1)] if saved else []),
        ("offload", None),
        ("wake", None),
        ("weights_changed", k + 1),
        ("log", k),
    ]
    assert record.calls == [("begin", 0), ("offload", None), *step(0, False), *step(1, True)]


def test_a_resumed_run_loads_serves_its_weights_and_goes_on_from_its_step():
    record = Recorder()
    done = run(_config(steps=4, load="ckpt"), FakeTrainer(record), FakeRollout(record), threading.Event())
    assert done == 4
    resumed = [("load", "ckpt"), ("resume", 2), ("export", 2), ("push", 2), ("begin", 2)]
    assert record.calls == [*resumed, *_step(2), *_step(3)]


@pytest.mark.parametrize("role", ["rollout", "trainer"])
def test_a_role_that_raises_stops_the_run_there_with_nothing_exported_or_saved_after(role):
    record = Recorder()
    trainer = FakeTrainer(record, fail_at=1 if role == "trainer" else None)
    rollout = FakeRollout(record, fail_at=1 if role == "rollout" else None)
    with pytest.raises(RuntimeError, match="in step 1"):
        run(_config(save="ckpt", save_interval=1), trainer, rollout, threading.Event())
    failed = [("generate", 1)] + ([("train", 1)] if role == "trainer" else [])
    assert record.calls == [("begin", 0), *_step(0, saved=True), *failed]


def test_a_stop_request_finishes_the_step_it_arrives_in_saves_and_returns():
    """Ctrl-C (or SIGTERM) while step 1 trains: step 1 exports, logs and saves as the last step does; no
    step 2 is generated."""
    record = Recorder()
    stop = threading.Event()
    done = run(
        _config(steps=5, save="ckpt", save_interval=10), FakeTrainer(record, stop=stop), FakeRollout(record), stop
    )
    assert done == 2
    assert record.calls == [("begin", 0), *_step(0), *_step(1, saved=True)]
