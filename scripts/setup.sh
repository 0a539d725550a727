#!/usr/bin/env bash
# Creates .venv and installs gemma-ane with every extra. Idempotent: re-runs only when
# pyproject.toml changes. torch is pinned first so pip takes the CPU wheel on this disk
# instead of resolving a multi-GB CUDA build for transformers/coremltools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.gemma-ane-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[all]"
  echo "$want" > "$stamp"
fi
