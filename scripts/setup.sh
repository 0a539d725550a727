#!/usr/bin/env bash
# Creates .venv and installs gemma-ane with every extra, saying each step (QUIET=1: silent). Idempotent: re-runs only when
# pyproject.toml changes. torch is pinned first so pip takes the CPU wheel on this disk
# instead of resolving a multi-GB CUDA build for transformers/coremltools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.gemma-ane-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
# pip's own progress (a minute or more of downloads and builds) unless QUIET=1
q=${QUIET:+-q}
say() { [ -n "${QUIET:-}" ] || echo "setup: $*" >&2; }
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "upgrading pip in .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  say "installing torch 2.13.0 (the CPU wheel)"
  .venv/bin/python -m pip install $q "torch==2.13.0"
  say "installing gemma-ane with every extra (-e '.[all]')"
  .venv/bin/python -m pip install $q -e ".[all]"
  echo "$want" > "$stamp"
  say "done"
else
  say ".venv is up to date (pyproject.toml unchanged)"
fi
