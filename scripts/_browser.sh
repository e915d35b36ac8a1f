# Chromium for the trajectory viewer's browser tests (tests/integration/inspection/test_viewer.py, tests/e2e/test_inspection.py), from the operating
# system's packages: a test tool's own browser download does not work offline. Installed when it is
# missing and this user can (root and apt-get); otherwise the browser tests are skipped with the reason.
# SLIME_MT_NO_BROWSER_INSTALL=1 leaves the system alone.
ensure_browser() {
    if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
        return 0
    fi
    if [ -n "${SLIME_MT_NO_BROWSER_INSTALL:-}" ] || [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "[setup] no Chromium, and not installing it (needs root and apt-get): the browser tests will be skipped"
        return 0
    fi
    echo "[setup] installing Chromium from the OS packages for the browser tests"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; } \
        || echo "[setup] apt-get could not install chromium: the browser tests will be skipped"
}
