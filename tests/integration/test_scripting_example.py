"""examples/scripting/one_step.py runs as its README says (issue 67 item 8): the in-process engine
samples a group, the actor's log-probs of the same tokens equal the engine's, one step trains (a grad
norm above 0) and the engine then serves the exported weights as version 1. Integration tier: one
process with a tiny Qwen2 engine and a Megatron actor, about 20 s."""

import re
import subprocess
import sys

from train_helpers import REPO


def test_the_scripting_example_samples_scores_trains_and_serves_the_new_weights():
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples/scripting/one_step.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    gap = float(re.search(r"trainer vs engine log-probs: largest gap (\S+)", proc.stdout).group(1))
    assert gap < 1e-4
    grad_norm = float(re.search(r"trained: loss \S+, grad norm (\S+)", proc.stdout).group(1))
    assert grad_norm > 0
    assert re.search(r"^the engine serves version 1: ", proc.stdout, re.MULTILINE), proc.stdout
