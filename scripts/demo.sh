#!/usr/bin/env bash
# The main job end to end on an embedded tiny model: make a random tiny Gemma 4 checkpoint,
# show the chunk plan, prove the chunk graph against transformers at every position, convert
# it to a Core ML bundle, inspect it, run the bundle itself against transformers, and generate
# with it (random weights: the text is gibberish, the pipeline is real).
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
# coremltools prints hundreds of progress lines: keep them in a log, show it only on failure
# --bits 16: 4-bit k-means on a 64-wide random model is far lossier than on E2B (see README)
gemma-ane convert "$OUT/tiny-e2b" "$OUT/bundle" --bits 16 --context 128 --force --quiet 2> "$OUT/convert.log" \
  || { tail -20 "$OUT/convert.log"; exit 1; }
gemma-ane inspect "$OUT/bundle"
gemma-ane verify "$OUT/tiny-e2b" --bundle "$OUT/bundle" --tokens 96 --prompt-tokens 13
# A random model's favourite token is a newline; a repetition penalty makes it show its (gibberish)
# text instead. The last line is the timings: tokens and tok/s for the prompt and the generation.
gemma-ane generate "$OUT/bundle" -p "Hello, who are you?" --max-tokens 24 --seed 0 --repetition-penalty 1.5 --backend mil
