"""Commands the end-to-end tests share."""

import os
import subprocess
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


# stop ids that end a tiny random model's turn early (so that geo3k episodes run several turns)
STOPS = [str(t) for t in list(range(3, 151643, 37)) + [151645]]
PLUGINS = '''
async def rm(args, sample):
    """Deterministic, varied rewards so that GRPO advantages are never all zero."""
    return float(sum(sample.tokens[-sample.response_length:]) % 3 == 0) + 0.1 * (sample.response_length % 2)
'''


def make_geo3k(out: Path) -> Path:
    """16 synthetic geo3k problems (train.jsonl, images/) and ``plugins.py`` (the ``rm`` above) in ``out``."""
    subprocess.run(
        [sys.executable, str(REPO / "scripts/prepare_geo3k.py"), "--synthetic", "16", "--out", str(out)],
        check=True,
        capture_output=True,
    )
    (out / "plugins.py").write_text(PLUGINS)
    return out


def geo3k_train_cmd(geo3k: Path, run: Path, *extra: str, tp: int = 1, steps: int = 2) -> list[str]:
    """``slime-mt train`` of the tiny Qwen2.5-VL on ``geo3k`` (``make_geo3k``) with the geo3k env, writing to
    ``run``: TP=``tp`` (under torchrun when > 1), ``steps`` steps, ``extra`` flags last."""
    from slime_mt.assets import tiny_model_dir
    from slime_mt.engine.launch import free_port

    launch = [sys.executable, "-m", "slime_mt.cli"]
    if tp > 1:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(tp),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "slime_mt.cli",
        ]
    return launch + [
        "train",
        "--hf-checkpoint",
        str(tiny_model_dir("qwen2.5-vl")),
        "--prompt-data",
        str(geo3k / "train.jsonl"),
        "--input-key",
        "messages",
        "--label-key",
        "answer",
        "--tool-key",
        "tools",
        "--multimodal-keys",
        '{"image": "images"}',
        "--rollout-interaction-env-path",
        str(REPO / "envs/geo3k.py"),
        "--custom-rm-path",
        f"{geo3k}/plugins.py:rm",
        "--max-turns",
        "3",
        "--rollout-max-response-len",
        "24",
        "--rollout-max-context-len",
        "1024",
        "--rollout-stop-token-ids",
        *STOPS,
        "--n-samples-per-prompt",
        "2",
        "--rollout-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--num-rollout",
        str(steps),
        "--lr",
        "1e-4",
        "--tensor-model-parallel-size",
        str(tp),
        "--save",
        str(run / "ckpt"),
        "--log-dir",
        str(run),
        *extra,
    ]
