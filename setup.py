"""slime_mt: multi-turn RL for LLMs and VLMs on Megatron-core, in the style of slime."""

from setuptools import find_packages, setup

setup(
    name="slime_mt",
    version="0.1.0",
    description="Multi-turn reinforcement learning for LLMs and VLMs with Megatron-core and SGLang",
    python_requires=">=3.10",
    packages=find_packages(include=["slime_mt", "slime_mt.*", "rollouts", "rollouts.*", "envs", "envs.*"]),
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.13,<0.17",  # 0.17+ needs Python 3.12 (docs/clusters.md, "Running on GPUs")
        "transformers>=4.57",
        "tokenizers>=0.21",
        "pillow",
        "pyyaml",
        "numpy",
        "safetensors",
        "httpx>=0.27",
        "orjson>=3.9",
        "ray>=2.40",
        "starlette>=0.40",
        "uvicorn>=0.30",
        "tqdm",
        "gguf>=0.10",
        "accelerate>=1.0",
        "pyarrow",
        "math-verify>=0.7",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            "pytest-timeout",
            "pytest-xdist>=3.6",  # scripts/test.sh runs the tests on two workers (--dist loadgroup)
            "sglang-router>=0.2",
            "matplotlib",
            "ruff==0.17.6",
            "openai>=1.50",  # the agent gateway is tested through the real clients
            "anthropic>=0.40",
            "bm25s>=0.2",  # envs.search
            "reasoning-gym>=0.1.20",  # envs.reasoning_tasks
            "websockets>=13",  # envs.openenv
            "playwright>=1.45",  # drives the OS's Chromium in the viewer's browser tests (no browser download)
            "peft>=0.13",  # reads the LoRA adapters the trainer exports (their format's reference)
            "mkdocs-material>=9.5",  # the docs site, built with --strict by the tests (scripts/docs.sh serves it)
        ],
        "docs": ["mkdocs-material>=9.5"],
        "envs": ["bm25s>=0.2", "reasoning-gym>=0.1.20", "websockets>=13"],  # the built-in environments' own needs
        "viz": ["matplotlib", "tensorboard"],
        "agent": ["openai>=1.50", "anthropic>=0.40"],  # the example agents (the gateway itself needs neither)
        # qwen-vl-utils imports torchvision (which sglang brings); on CPU --slime-compat maps the name
        "gpu": ["sglang>=0.5", "sglang-router>=0.2", "qwen-vl-utils>=0.0.14"],
    },
    package_data={"slime_mt.inspection": ["viewer.html"]},
    entry_points={"console_scripts": ["slime-mt=slime_mt.cli:main"]},
)
