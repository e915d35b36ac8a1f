#!/usr/bin/env bash
# Create .venv if missing, install slime_mt with test extras, run the test suite.
# Extra arguments go to pytest: bash scripts/test.sh tests/test_config.py -k yaml
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv "test"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
