"""One run per run folder (slime_mt/run_dir.py): the lock, the refusal of an earlier run's folder, the
resume and the start-over that moves the earlier files aside. Unit tier: files only, well under 1 s."""

import pytest

from slime_mt.config_parsing import parse_config
from slime_mt.errors import RunDirError
from slime_mt.run_dir import LOCK_FILE, claim_run_dir


def config(run, *flags):
    return parse_config(["--hf-checkpoint", "unused", "--log-dir", str(run), *flags])


def earlier_run(run, save=None):
    """A folder as a finished run leaves it (its files and, with ``save``, a checkpoint)."""
    run.mkdir(parents=True, exist_ok=True)
    for name, text in {"metrics.jsonl": '{"step": 0}\n', "config.yaml": "old: 1\n", "train.log": "old\n"}.items():
        (run / name).write_text(text)
    (run / "reward.png").write_bytes(b"png")
    (run / "data").mkdir(exist_ok=True)
    (run / "data" / "train.jsonl").write_text("{}\n")
    if save is not None:
        (save / "iter_0000002").mkdir(parents=True)
        (save / "latest").write_text("iter_0000002")


def test_an_empty_or_new_folder_is_claimed_and_locked_against_a_second_run(tmp_path):
    run = tmp_path / "run"
    lock = claim_run_dir(run, config(run))
    assert "pid " in (run / LOCK_FILE).read_text()
    with pytest.raises(RunDirError, match="in use by another run \\(pid .*\\); give each run its own --log-dir"):
        claim_run_dir(run, config(run))  # a second open file: flock refuses it as it refuses another process
    lock.close()
    claim_run_dir(run, config(run)).close()  # free again once the first run ends


def test_an_earlier_run_is_refused_naming_its_files_and_the_ways_on(tmp_path):
    run = tmp_path / "run"
    earlier_run(run, save=run / "ckpt")
    with pytest.raises(RunDirError) as refused:
        claim_run_dir(run, config(run, "--save", str(run / "ckpt")))
    assert str(refused.value) == (
        f"run folder {run} holds an earlier run (config.yaml, train.log, metrics.jsonl, ckpt/latest): resume it "
        f"with --load {run / 'ckpt'}, start over with --overwrite-run-dir (its files move to {run}/earlier-<time>/, "
        "nothing is deleted), or give this run another --log-dir"
    )
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'  # a refused run changed nothing
    # the lock of the refused run was let go: a resume of the earlier run claims the folder as it is
    claim_run_dir(run, config(run, "--save", str(run / "ckpt"), "--load", str(run / "ckpt"))).close()
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_overwrite_run_dir_moves_the_earlier_run_aside_and_deletes_nothing(tmp_path):
    run, save = tmp_path / "run", tmp_path / "checkpoints"
    earlier_run(run, save=save)
    claim_run_dir(run, config(run, "--save", str(save), "--overwrite-run-dir")).close()
    [aside] = run.glob("earlier-*")
    assert sorted(p.name for p in aside.iterdir()) == [
        "checkpoints",
        "config.yaml",
        "metrics.jsonl",
        "reward.png",
        "train.log",
    ]
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["iter_0000002", "latest"]
    assert (aside / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert not (run / "metrics.jsonl").exists() and not (save / "latest").exists()
    assert (run / "data" / "train.jsonl").exists()  # what is not a run's output stays where it was
