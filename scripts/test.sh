#!/usr/bin/env bash
# The test suite, from a clean clone: installs what it needs, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (the machine CI runs on has two cores); a test file stays on one worker, so its
# module fixtures are built once, and the shared bundles are converted once for both (conftest.py).
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25 "$@"
