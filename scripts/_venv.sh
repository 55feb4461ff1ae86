#!/usr/bin/env bash
# Create (or reuse) ./.venv with Python >= 3.12 and mhc-megatron installed with the
# test and demo extras. Re-installs when pyproject.toml changes. Sourced by the other
# scripts; prints which interpreter it uses.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

find_python() {
  local c
  for c in python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then  # pyenv installs that are not active; oldest >= 3.12 first
    local v
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9](\.|$)' | sort -V); do
      if [ -x "$(pyenv root)/versions/$v/bin/python3" ]; then
        echo "$(pyenv root)/versions/$v/bin/python3"; return 0
      fi
    done
  fi
  echo "error: mhc-megatron needs Python >= 3.12 (megatron-core >= 0.17 does); none found" >&2
  return 1
}

# pip install, quiet, without its "Location" warnings; fails with pip's own exit status
pip_install() {
  "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}

install_failed() {
  local free
  free="$(df -Ph "$ROOT" 2>/dev/null | awk 'NR == 2 {print $4}')"
  echo "error: $1 (the messages above say why). The venv needs about 6 GB of disk (torch's" \
       "CUDA build); ${free:-?} is free under $ROOT. Fix what they name (disk space, the" \
       "network, a version pin), then run the command again: it resumes in the same venv." >&2
  exit 1
}

stamp="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.mhc-stamp" 2>/dev/null)" != "$stamp" ]; then
  PY="$(find_python)"
  echo "[venv] creating $VENV with $PY ($("$PY" --version))"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip_install --upgrade pip || echo "warning: upgrading pip in $VENV failed; going on with its pip" >&2
  pip_install -e "$ROOT[test,demo]" || install_failed "pip could not install mhc-megatron into $VENV"
  "$VENV/bin/python" -W ignore -c "import mhc_megatron, megatron.core, torch, pytest" \
    || install_failed "mhc-megatron, megatron.core, torch or pytest does not import from $VENV"
  echo "$stamp" > "$VENV/.mhc-stamp"
fi
export PATH="$VENV/bin:$PATH"
