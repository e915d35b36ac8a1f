"""Commands the end-to-end tests share, and running and reading their runs."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parent  # tests/helpers: on sys.path in tests and their children
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
    """This process's environment for a child run from the repo: the repo and tests/helpers first on
    ``PYTHONPATH``, whatever was there kept (packages installed on PYTHONPATH, as on a GPU machine),
    ``extra`` set."""
    path = os.pathsep.join(p for p in (str(REPO), str(HELPERS), os.environ.get("PYTHONPATH")) if p)
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


def geo3k_train_cmd(
    geo3k: Path,
    run: Path,
    *extra: str,
    tp: int = 1,
    steps: int = 2,
    model: str = "qwen2.5-vl",
    ranks: int | None = None,
) -> list[str]:
    """``slime-mt train`` of a tiny VLM (``model``, Qwen2.5-VL by default) on ``geo3k`` (``make_geo3k``)
    with the geo3k env, writing to ``run``: TP=``tp``, ``ranks`` processes (default ``tp``; under
    torchrun when > 1), ``steps`` steps, ``extra`` flags last."""
    from slime_mt.assets import tiny_model_dir

    ranks = ranks or tp
    launch = [sys.executable, "-m", "slime_mt.cli"]
    if ranks > 1:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # the rendezvous binds a port of its own: no race with another run's
            "--nproc-per-node",
            str(ranks),
            "-m",
            "slime_mt.cli",
        ]
    return launch + [
        "train",
        "--hf-checkpoint",
        str(tiny_model_dir(model)),
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


# ---------------------------------------------------------------- running and reading runs


def run(cmd, timeout=600, **kw) -> subprocess.CompletedProcess:
    """``cmd`` from the repo with ``repo_env()``, its output captured as text."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=repo_env(), cwd=REPO, **kw)


def metrics(run_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl``, a dict per step."""
    from slime_mt.metrics import read_metrics

    return read_metrics(run_dir)


def kill_after_two_steps(cmd, run_dir: Path) -> None:
    """Start a run saving every step into ``run_dir/ckpt`` and SIGKILL it half a second after its second
    metrics line and its second checkpoint (written after that line, later on a loaded machine): the
    third step runs."""
    child = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=repo_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and child.poll() is None:
        lines, latest = run_dir / "metrics.jsonl", run_dir / "ckpt" / "latest"
        logged = lines.is_file() and len(lines.read_text().splitlines()) >= 2
        if logged and latest.is_file() and int(latest.read_text().removeprefix("iter_") or 0) >= 2:
            break
        time.sleep(0.2)
    time.sleep(0.5)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def final_weights(run_dir: Path) -> dict:
    """The last checkpoint's weights (an HF-layout folder)."""
    from slime_mt.safetensors_files import load_hf_state

    ckpt = run_dir / "ckpt"
    return load_hf_state(ckpt / (ckpt / "latest").read_text())


def initial_decoder(name: str):
    """The tiny Qwen2.5-VL's starting weight ``name`` (a tensor)."""
    from slime_mt.assets import tiny_model_dir
    from slime_mt.safetensors_files import load_hf_state

    return load_hf_state(tiny_model_dir("qwen2.5-vl"))[name]


# one trajectory in flight at a time and a checkpoint every step: runs that equal each other step by step
DETERMINISTIC = ["--rollout-concurrency", "1", "--save-interval", "1"]
# TP=2 with a rank on each of two Ray nodes (a declared GPU each)
RAY_TP2 = ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1"]


def ray_cmd(geo3k: Path, run_dir: Path, cluster, *extra: str, steps: int = 3) -> list[str]:
    """``geo3k_train_cmd`` at TP=2, launched by ``--ray`` on ``cluster`` (two ranks on two nodes, one engine)."""
    cmd = geo3k_train_cmd(geo3k, run_dir, *extra, tp=2, steps=steps)
    flags = cmd[cmd.index("train") :]
    return [sys.executable, "-m", "slime_mt.cli", *flags, "--ray", "--ray-address", cluster.address, *RAY_TP2]


ENV_WORKERS = ["--env-num-workers", "2", "--env-worker-num-cpus", "0.5"]
ROLLOUT_PROCESSES = ["--rollout-num-processes", "2", "--rollout-process-num-cpus", "0.25"]


def placement_lines(text: str) -> dict[str, str]:
    """'trainer rank 0' / 'engine 0' / 'env worker 0' -> the node id its placement line names (rank 0's
    lines come through Ray's log forwarding, after the actor's prefix)."""
    found = {}
    for line in text.splitlines():
        if "placement: " in line and ": node " in line:
            role, where = line.split("placement: ", 1)[1].split(": ", 1)
            found[role] = where.split("(", 1)[1].split(")", 1)[0]
    return found
