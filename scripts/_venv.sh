# shellcheck shell=bash
# Sourced by the scripts in this folder: make sure ROOT/.venv exists with this project installed.
# First use creates it (≈2 min); later uses only check a stamp of pyproject.toml. Sets $PY.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.ntp-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$PY" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  base=""
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      base="$cand"; break
    fi
  done
  if [ -z "$base" ]; then
    echo "ntp-megatron needs Python 3.11 (python3.11 or python3 on PATH)" >&2
    exit 1
  fi
  echo "ntp-megatron: installing into $VENV (first use only)..." >&2
  [ -x "$PY" ] || "$base" -m venv "$VENV"
  # torch first, pinned: the CPU wheel of 2.13.0 is what this project is tested with (the package itself allows
  # torch>=2.6, so that installing it where torch already is, a GPU container, keeps that torch); an unpinned
  # torch pulled in by another package would be a multi-GB CUDA build.
  if ! "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" \
      || ! "$PY" -m pip install --quiet --disable-pip-version-check -e "${ROOT}[test]"; then
    echo "ntp-megatron: installation failed" >&2
    exit 1
  fi
  echo "$want" > "$STAMP"
fi
