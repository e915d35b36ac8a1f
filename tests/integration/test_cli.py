import subprocess
import sys


def test_unknown_cli_flag_exits_nonzero_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "slime_mt.cli", "train", "--no-such-flag"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "--no-such-flag" in proc.stderr


def test_help_lists_flags_grouped_by_concern():
    proc = subprocess.run([sys.executable, "-m", "slime_mt.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    text = proc.stdout
    groups = ("data", "rollout", "engine", "cluster", "algo", "train", "checkpoint")
    positions = [text.index(f"\n  {group}:") for group in groups]
    assert positions == sorted(positions)
    assert text.index("--rollout-function-path") > positions[1]
    assert positions[3] < text.index("--actor-num-nodes") < positions[4]
    assert text.index("--eps-clip-high") > positions[4]
    assert text.index("\n    --tensor-model-parallel-size") > positions[5]
