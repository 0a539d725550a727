#!/usr/bin/env bash
# The main job end to end on an embedded tiny model that answers: write the tiny Gemma 4 trained on a small
# chat corpus (gemma_ane/oracle/demo_corpus.py; its weights ship with the package), plan it, prove the chunk graph
# against transformers,
# convert it to a Core ML bundle, inspect and audit it, prove the bundle against transformers, and
# ask it questions whose answers can be checked, one about a picture. Each step says what it proves and how
# long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-demo}
T0=$SECONDS
step() {  # step N "what it proves": a header, and the previous step's time
  [ -n "${STEP_START:-}" ] && echo "    ($((SECONDS - STEP_START)) s)"
  STEP_START=$SECONDS
  printf '\n== [%s/10] %s\n' "$1" "$2"
}

step 1 "setup: .venv with torch 2.13 (CPU) and gemma-ane[all] (skipped when up to date)"
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
mkdir -p "$OUT"

step 2 "the tiny Gemma 4 trained to answer and to caption four pictures (shipped weights; --train trains anew): $OUT/ckpt"
gemma-ane tiny "$OUT/ckpt" --preset demo --force

step 3 "the chunk plan: which layers, caches and functions each Core ML chunk gets"
gemma-ane plan "$OUT/ckpt" --context 512 --bits 16  # as step 5 converts it

step 4 "the PyTorch chunk graph equals transformers at every position (fp32)"
gemma-ane verify "$OUT/ckpt" --tokens 160 --prompt-tokens 24 --precision fp32

step 5 "convert to a Core ML bundle (16-bit weights, context 512, the vision tower; a bar a chunk)"
# --no-audio: the tiny presets' audio tower is a placeholder too narrow to run (transformers' own projection needs
# 128 subsampling channels), which convert would otherwise leave out with a note
gemma-ane convert "$OUT/ckpt" "$OUT/bundle" --bits 16 --context 512 --no-audio --force

step 6 "what the bundle holds, and the static audit against the Neural Engine's rules"
# into a file, then its head: `inspect | head` ends inspect with SIGPIPE once head has its lines (exit 141),
# which pipefail turns into the demo's failure
gemma-ane inspect "$OUT/bundle" > "$OUT/inspect.txt"
head -20 "$OUT/inspect.txt"
gemma-ane inspect "$OUT/bundle" --ane | tail -3

step 7 "the saved bundle (run by the MIL executor, fp16) equals transformers at every position"
gemma-ane verify "$OUT/ckpt" --bundle "$OUT/bundle" --tokens 160 --prompt-tokens 24

step 8 "ask it: a question, and the same question as JSON following a schema"
gemma-ane generate "$OUT/bundle" -p "What is the capital of France?" --backend mil
gemma-ane generate "$OUT/bundle" -p "Give the capital of France as JSON." --backend mil \
  --json-schema '{"type":"object","properties":{"country":{"type":"string"},"capital":{"type":"string"}},"required":["country","capital"]}'

step 9 "function calling through the Python API: the model calls get_weather, then reports its result"
python - "$OUT/bundle" <<'PY'
import json, sys, warnings

import gemma_ane
from gemma_ane.oracle.demo_corpus import WEATHER

warnings.simplefilter("ignore")  # the tiny template has no tool macros: the built-in formatter renders tools
model = gemma_ane.load(sys.argv[1], backend="mil")
messages = [{"role": "user", "content": "What is the weather in Paris?"}]
first = model.generate(messages=messages, tools=[WEATHER])
call = first.tool_calls[0]
print(f"call: {call.name}({json.dumps(call.arguments)})")
messages += [
    {"role": "assistant", "tool_calls": [call.to_openai()]},
    {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": '{"temperature": 18, "sky": "sunny"}'},
]
print("answer:", model.generate(messages=messages, tools=[WEATHER]).text)
PY

step 10 "a picture described: the PNG through the runtime's preprocessing, the bundle's vision model, then the chunks"
# one of the four pictures the model was taught (gemma_ane/oracle/demo_corpus.py draws them), written as a file
python -c "from gemma_ane.oracle.demo_corpus import picture; picture('red_square').save('$OUT/red_square.png')"
gemma-ane generate "$OUT/bundle" --image "$OUT/red_square.png" -p "Describe the picture." --backend mil

echo "    ($((SECONDS - STEP_START)) s)"
printf '\nDone in %d s: written, planned, proven (graph and bundle) against transformers, converted, audited and\n' \
  $((SECONDS - T0))
echo "answered. The bundle is $OUT/bundle; activate the environment with: source .venv/bin/activate"
