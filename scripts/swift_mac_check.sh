#!/usr/bin/env bash
# For a person with a Mac (macOS 15+, Xcode 16+): what Linux cannot prove about the Swift package. Runs `swift test`
# against Core ML itself (the CoreML* tests compare Core ML's outputs, states and greedy tokens with the Python MIL
# executor's on tiny bundles), then converts a small bundle (the demo model, or BUNDLE if given) and checks that
# `gemma-ane-swift generate --backend coreml` gives the same token ids as `gemma-ane generate --backend coreml`.
# Usage: bash scripts/swift_mac_check.sh [BUNDLE]      (both run on the Python CLI's default compute units, cpu_and_ne)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(uname)" = Darwin ] || { echo "swift_mac_check: run this on a Mac (Core ML needs macOS)" >&2; exit 2; }
command -v swift >/dev/null || { echo "swift_mac_check: no swift on PATH (install Xcode 16 or later)" >&2; exit 2; }
prompt="What is the capital of France?"

QUIET=1 bash scripts/setup.sh
export GEMMA_ANE_PYTHON="$PWD/.venv/bin/python" PYTHONPATH="$PWD"

echo "== swift test (Core ML itself behind the CoreML* tests)"
swift test

bundle=${1:-}
if [ -z "$bundle" ]; then
  bundle=demo/bundle
  if [ ! -d "$bundle" ]; then
    echo "== converting the demo model to $bundle"
    .venv/bin/gemma-ane tiny demo/ckpt --preset demo --force
    .venv/bin/gemma-ane convert demo/ckpt "$bundle" --force --quiet
  fi
fi

echo "== the same prompt through both, greedy, on the CPU and Neural Engine"
swift build -c release --product gemma-ane-swift
out=$(mktemp -d)
.venv/bin/gemma-ane generate "$bundle" -p "$prompt" --backend coreml --temperature 0 --max-tokens 16 --json > "$out/python.json"
.build/release/gemma-ane-swift generate "$bundle" --prompt "$prompt" --backend coreml --compute-units cpu_and_ne \
  --temperature 0 --max-tokens 16 --json > "$out/swift.json"
tokens() { .venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1]))["tokens"])' "$1"; }
echo "python: $(tokens "$out/python.json")"
echo "swift:  $(tokens "$out/swift.json")"
if [ "$(tokens "$out/python.json")" = "$(tokens "$out/swift.json")" ]; then
  echo "swift_mac_check: OK, the same tokens"
else
  diff <(tokens "$out/python.json") <(tokens "$out/swift.json") || true
  echo "swift_mac_check: the token ids differ (a near-tie in fp16 can: compare the logits' margins)" >&2
  exit 1
fi
