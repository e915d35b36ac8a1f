#!/usr/bin/env bash
# The docs site, served at http://127.0.0.1:8000 while you edit docs/ (it rebuilds on every save). The flags
# reference and the code map are written from the code first (scripts/docs_pages.py); each example's page is
# its README. Extra arguments go to mkdocs serve (bash scripts/docs.sh -a 127.0.0.1:8001); `build` instead
# writes the static site to site/ with --strict, as CI builds it: bash scripts/docs.sh build
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv "test"
export NO_MKDOCS_2_WARNING=1
.venv/bin/python scripts/docs_pages.py
if [ "${1:-}" = "build" ]; then
    shift
    exec .venv/bin/mkdocs build --strict "$@"
fi
exec .venv/bin/mkdocs serve -a 127.0.0.1:8000 "$@"
