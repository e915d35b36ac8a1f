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


HEAVY = ("torch", "megatron", "ray", "transformers", "vllm", "openai", "safetensors")
PRINT_HEAVY = f"print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"


def test_help_and_an_asset_path_import_no_framework(tiny_paths):  # the assets built: the child only looks up
    """``slime-mt train --help`` and a cached asset's path (what the recipes ask before they start a run)
    import none of torch, Megatron, Ray, transformers, vLLM or openai: each process the tests and the
    recipes start pays only for what its path needs (``train --help``: 5.0 s -> 0.2 s, an asset's
    path 2.8 s -> 0.07 s on the 2-core machine). Integration tier: two Python starts, about 1 s."""
    code = (
        "import sys\n"
        "from slime_mt import cli\n"
        "sys.argv = ['slime-mt', 'train', '--help']\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
    )
    proc = subprocess.run([sys.executable, "-c", code + PRINT_HEAVY], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--rollout-function-path" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "HEAVY []", proc.stdout[-500:]
    code = "import sys\nfrom slime_mt.assets import tiny_model_dir\nprint(tiny_model_dir('qwen2.5-vl'))\n"
    proc = subprocess.run([sys.executable, "-c", code + PRINT_HEAVY], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == str(tiny_paths["qwen2.5-vl"])
    assert proc.stdout.splitlines()[-1] == "HEAVY []", proc.stdout[-500:]
