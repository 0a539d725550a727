"""The Swift package's host work (swift/Sources/GemmaANE), against the Python runtime on the same inputs.

    python bench/swift_host.py              # E2B's vocabulary: 262,144 logits, a 262,144-piece tokenizer.json
    python bench/swift_host.py --quick      # a 4,096-entry vocabulary and a debug build, for the test suite

Builds the `gemma-ane-bench` executable (`swift build -c release`), then times, in it and in the Python runtime:
the host work per decoded token as the engine does it (the token's embedding and PLE rows read from real-size int8
sidecars and dequantised, its RoPE rows and masks, then the draw; target <= 1 ms median with top-k/top-p/penalties);
the sampler alone on fp16 logits (the head's) for several parameter sets, with a 1,000-token history for the
penalties, the two checked to draw the same tokens from the same seed; and the load of a generated
SentencePiece-style tokenizer.json of the real size (Gemma's pipeline, one merge per piece; target <= 2 s) against
`tokenizers.Tokenizer.from_file`. Ratios are Swift / Python.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, publish  # noqa: E402

from gemma_ane.bundle import load_host  # noqa: E402
from gemma_ane.bundle.host import full_mask, sliding_mask  # noqa: E402
from gemma_ane.runtime.sampling import Sampler, SamplingParams  # noqa: E402
from gemma_ane.runtime.tokens import SPECIAL_TOKENS  # noqa: E402

SETS = {  # name: (temperature, top_k, top_p, min_p, repetition, presence, frequency)
    "top-k 64, top-p 0.9, T 0.8, penalties": (0.8, 64, 0.9, 0.0, 1.1, 0.5, 0.2),
    "greedy": (0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0),
    "top-k 40, T 0.7": (0.7, 40, 1.0, 0.0, 1.0, 0.0, 0.0),
    "top-p 0.9 alone (whole vocabulary)": (1.0, 0, 0.9, 0.0, 1.0, 0.0, 0.0),
    "T 1 alone (whole vocabulary)": (1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0),
}
HISTORY = 1000


def build(quick: bool) -> Path:
    mode = "debug" if quick else "release"
    env = {**os.environ, "PATH": "/opt/swift/usr/bin:" + os.environ.get("PATH", "")}
    cmd = ["swift", "build", "-c", mode, "--product", "gemma-ane-bench"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"swift build failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return ROOT / ".build" / mode / "gemma-ane-bench"


def swift(binary: Path, *args) -> dict:
    r = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr.strip())
    return json.loads(r.stdout)


def logits(vocab: int, rows: int) -> np.ndarray:
    """fp16 rows with a peaked head, as the head returns them."""
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 2.0, (rows, vocab))
    x[:, rng.integers(0, vocab, 16)] += 8.0
    return x.astype(np.float16)


def host_root(root: Path, quick: bool) -> tuple[Path, dict]:
    """host_overhead.py's random sidecars (real size: 2.7 GB) and the model_config.json the Swift side reads."""
    from host_overhead import E2B, QUICK, write_sidecars

    config = write_sidecars(root, QUICK if quick else E2B)
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "per_layer_dim", "embed_scale", "per_layer_embed_scale")
    model = {k: config[k] for k in fields}
    layers = config["num_hidden_layers"]  # Gemma's pattern: every fifth layer full attention, and the last
    kinds = ["full_attention" if i % 5 == 4 or i == layers - 1 else "sliding_attention" for i in range(layers)]
    model |= {
        "layer_types": kinds,
        "sliding_window": config["window"],
        "context_length": config["context"],
    }
    (root / "model_config.json").write_text(json.dumps(model))
    return root, model


def python_sampler(x: np.ndarray, values, steps: int, host=None) -> tuple[list[float], list[int]]:
    """The Python runtime's draws (and, given (tables, config), its host work per token as the Swift bench does it)."""
    t, k, p, m, r, pres, freq = values
    params = SamplingParams(t, k, p, m, r, pres, freq, seed=7)
    vocab = x.shape[1]
    sampler = Sampler(params, history=[(i * 7919) % vocab for i in range(HISTORY)])
    times, tokens, token = [], [], 2
    for step in range(steps):
        start = time.perf_counter()
        if host is not None:
            tables, config = host
            context, window = config["context_length"], config["sliding_window"]
            position = 1000 + step % (context - 1000)
            tables.embed(np.array([token]))
            tables.rope_rows("sliding_attention", position, 1), tables.rope_rows("full_attention", position, 1)
            full_mask(position, 1, context), sliding_mask(position, 1, window)
        token = sampler.sample(x[step % len(x)])
        sampler.observe(token)
        times.append((time.perf_counter() - start) * 1000)
        tokens.append(token)
    return times, tokens


def tokenizer_file(path: Path, vocab: int) -> Path:
    """Gemma's pipeline at `vocab` pieces: the control tokens, 256 <0xHH> bytes, the characters of a few scripts,
    then pieces each made by one merge of two earlier ones (a word start ▁ in half of them)."""
    pieces = [SPECIAL_TOKENS.get(i, f"<unused{i}>") for i in range(128)] + [f"<0x{b:02X}>" for b in range(256)]
    chars = [chr(c) for c in [*range(0x21, 0x7F), *range(0xE0, 0x100), *range(0x430, 0x450), *range(0x4E00, 0x5000)]]
    pieces += ["▁", *chars]
    ids = {p: i for i, p in enumerate(pieces)}
    # each new piece a shorter one and a character, or a word start and a piece: BPE's merges grow words so
    short = list(range(384, len(pieces)))
    merges, draws = [], np.random.default_rng(0).integers(0, 2**31, size=(8 * vocab, 3)).tolist()
    for a, b, start in draws:
        if len(pieces) >= vocab:
            break
        left, right = pieces[short[a % len(short)]], chars[b % len(chars)]
        if start % 2 and not left.startswith("▁"):
            left, right = "▁", left
        if left + right in ids:
            continue
        ids[left + right] = len(pieces)
        if len(left + right) < 12:
            short.append(len(pieces))
        pieces.append(left + right)
        merges.append([left, right])
    added = [
        {"id": i, "content": p, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, p in enumerate(pieces[:128])
    ]  # fmt: skip
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"String": " "},
            "behavior": "MergedWithPrevious",
            "invert": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": ids, "merges": merges},
    }  # fmt: skip
    path.write_text(json.dumps(doc, ensure_ascii=False))
    return path


def stats(times: list[float]) -> tuple[float, float]:
    return statistics.median(times), float(np.percentile(times, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 4,096-entry vocabulary and a debug build")
    ap.add_argument("--steps", type=int, default=200, help="decoded tokens timed per parameter set")
    ap.add_argument("--record", action="store_true", help="append the results to BENCHMARKS.md")
    args = ap.parse_args()
    vocab, steps = (4096, 20) if args.quick else (262_144, args.steps)
    binary = build(args.quick)
    lines = [f"vocabulary {vocab:,}, {steps} tokens per set, history {HISTORY}, `gemma-ane-bench` "
             f"({'debug' if args.quick else 'release'})", "",
             "| sampler, per token | Swift median ms | Swift p99 ms | Python median ms | Swift / Python "
             "| same tokens |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        x = logits(vocab, 8)
        rows = Path(tmp) / "logits.bin"
        x.astype("<f4").tofile(rows)
        root, config = host_root(Path(tmp), args.quick)
        values = SETS["top-k 64, top-p 0.9, T 0.8, penalties"]
        s = swift(binary, "host", root, rows, vocab, steps, *values)
        py_times, py_tokens = python_sampler(x, values, steps, (load_host(root, config), config))
        (sm, sp), (pm, _) = stats(s["token_ms"]), stats(py_times)
        headline = (
            f"Swift host work per decoded token (embedding and PLE rows, RoPE rows, masks, top-k 64, top-p 0.9, "
            f"T 0.8, penalties): median {sm:.3f} ms, p99 {sp:.3f} ms (target <= 1 ms); Python runtime {pm:.3f} ms, "
            f"Swift / Python {sm / pm:.2f}; same tokens: {'yes' if s['tokens'] == py_tokens else 'NO'}"
        )
        for name, values in SETS.items():
            n = min(steps, 50) if "whole" in name else steps  # tens of ms a token: fewer suffice
            s = swift(binary, "sampler", rows, vocab, n, *values)
            py_times, py_tokens = python_sampler(x, values, n)
            (sm, sp), (pm, _) = stats(s["token_ms"]), stats(py_times)
            same = "yes" if s["tokens"] == py_tokens else "NO"
            lines.append(f"| {name} | {sm:.3f} | {sp:.3f} | {pm:.3f} | {sm / pm:.2f} | {same} |")
        start = time.perf_counter()
        path = tokenizer_file(Path(tmp) / "tokenizer.json", vocab)
        made = time.perf_counter() - start
        t = swift(binary, "tokenizer", path, 3)
        from tokenizers import Tokenizer

        py_loads, py_cpu = [], []
        for _ in range(3):
            start, cpu = time.perf_counter(), time.process_time()
            Tokenizer.from_file(str(path))
            py_loads.append((time.perf_counter() - start) * 1000)
            py_cpu.append((time.process_time() - cpu) * 1000)
        load, py_load = statistics.median(t["load_ms"]), statistics.median(py_loads)
        load_cpu, py_load_cpu = statistics.median(t["load_cpu_ms"]), statistics.median(py_cpu)
        size = path.stat().st_size / 2**20
    lines += [
        "",
        f"tokenizer.json of {t['vocab']:,} pieces ({size:.1f} MB, generated in {made:.1f} s): Swift load median "
        f"{load / 1000:.2f} s, {load_cpu / 1000:.2f} s of CPU (target <= 2 s), Python `tokenizers` "
        f"{py_load / 1000:.2f} s, {py_load_cpu / 1000:.2f} s of CPU; Swift / Python {load / py_load:.2f} "
        f"(CPU {load_cpu / py_load_cpu:.2f}); Swift encode of {t['encoded_tokens']} tokens {t['encode_ms']:.1f} ms",
    ]
    body = "\n".join([headline, "", *lines])
    publish("Swift host work (sampler, tokenizer load)", body, args)


if __name__ == "__main__":
    main()
