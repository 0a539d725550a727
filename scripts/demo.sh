#!/usr/bin/env bash
# The main job end to end on an embedded tiny model: make a random tiny Gemma 4 checkpoint,
# show the chunk plan, and prove the chunk graph against transformers at every position.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
OUT=${OUT:-demo}
mkdir -p "$OUT"
gemma-ane tiny "$OUT/tiny-e2b" --preset e2b-mini --seed 0 --force
gemma-ane plan "$OUT/tiny-e2b" --context 128
gemma-ane verify "$OUT/tiny-e2b" --tokens 96 --prompt-tokens 13 --precision fp32
gemma-ane verify "$OUT/tiny-e2b" --tokens 96 --prompt-tokens 13 --precision fp16
