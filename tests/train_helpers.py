"""Commands the end-to-end tests share."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# two steps of the demo's recipe at a quarter of its samples (one prompt x 4 samples per step)
TWO_SMALL_STEPS = [
    "--num-rollout",
    "2",
    "--n-samples-per-prompt",
    "4",
    "--rollout-batch-size",
    "1",
    "--global-batch-size",
    "4",
]


def demo_train_cmd(model: Path, prompt_data: Path, run_dir: Path, *extra: str) -> list[str]:
    """``slime-mt train`` with the demo's recipe (examples/demo/config.yaml) on a model folder and a
    prompt file, writing to ``run_dir``; ``extra`` flags win over the recipe."""
    return [
        sys.executable,
        "-m",
        "slime_mt.cli",
        "train",
        "--config",
        str(REPO / "examples/demo/config.yaml"),
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(prompt_data),
        "--log-dir",
        str(run_dir),
        *extra,
    ]


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child run from the repo: the repo first on ``PYTHONPATH``,
    whatever was there kept (packages installed on PYTHONPATH, as on a GPU machine), ``extra`` set."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)
