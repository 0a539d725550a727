"""The runtime's host work per decoded token, with chunks that answer instantly.

    python bench/host_overhead.py               # real E2B sizes: 262,144-row int8 sidecars (2.7 GB)
    python bench/host_overhead.py --quick       # small tables, for the test suite

Per token: embedding + PLE row reads (pread) and dequantisation from the sidecars, masks, RoPE rows,
the chunk calls (precomputed outputs), repetition/presence penalties, top-k/top-p sampling over
the whole vocabulary (on chunk_3's fp16 logits, as the runtime does), and with --logprobs the
chosen token's logprob (opt-in in the runtime: a log-sum-exp over the whole vocabulary). Prints
median and p99 per token (target: <= 1 ms median) and the resident memory after the run, which
must not grow with the table size.

Then structured output (gemma_ane.runtime.grammar): the per-token cost of the grammar mask and of consuming
the token, for any JSON object, an 8-field schema and a forced tool call, over a vocabulary of the
real size whose tokens are nearly all text (the tiny tokenizer padded to that size is nearly all
special tokens, which no grammar allows: a mask over it would cost nothing); the one-time tokenizer
build, the grammar's compile per request, and a draw from the masked logits.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402

from gemma_ane.bundle import load_host  # noqa: E402
from gemma_ane.oracle.tokenizer_files import MIN_VOCAB_SIZE, build_tokenizer  # noqa: E402
from gemma_ane.runtime.engine import Engine  # noqa: E402
from gemma_ane.runtime.grammar import Constraint, response_grammar, tool_call_grammar  # noqa: E402
from gemma_ane.runtime.sampling import Sampler, SamplingParams  # noqa: E402
from gemma_ane.runtime.tokens import (
    EOS,
    STRING_DELIM,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_OPEN,
    TURN_CLOSE,
    byte_symbols,
)

E2B = dict(
    vocab_size=262144,
    hidden_size=1536,
    num_hidden_layers=35,
    per_layer_dim=256,
    context=2048,
    window=512,
    head_dim=256,
    global_head_dim=512,
)
QUICK = dict(
    vocab_size=4096,
    hidden_size=64,
    num_hidden_layers=4,
    per_layer_dim=16,
    context=256,
    window=32,
    head_dim=32,
    global_head_dim=64,
)


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_sidecars(root: Path, d: dict) -> dict:
    """Random int8 tables of the given size, streamed to disk in blocks (never whole in memory)."""
    V, H, PL = d["vocab_size"], d["hidden_size"], d["num_hidden_layers"] * d["per_layer_dim"]
    rng = np.random.default_rng(0)
    for name, cols in (("embed_tokens", H), ("embed_tokens_per_layer", PL)):
        with open(root / f"{name}_q8.bin", "wb") as f:
            for start in range(0, V, 4096):
                f.write(rng.integers(-127, 128, size=(min(4096, V - start), cols), dtype=np.int8).tobytes())
        (root / f"{name}_scales.bin").write_bytes(rng.uniform(0.01, 0.1, V).astype("<f2").tobytes())
    for short, dim in (("sliding", d["head_dim"]), ("full", d["global_head_dim"])):
        for kind in ("cos", "sin"):
            np.save(
                root / f"{kind}_{short}.npy", rng.standard_normal((max(d["context"], 4096), dim)).astype(np.float16)
            )
    return {
        **d,
        "embed_scale": H**0.5,
        "per_layer_embed_scale": d["per_layer_dim"] ** 0.5,
        "layer_types": ["sliding_attention", "full_attention"],
    }


class Instant:
    """A chunk backend that returns precomputed outputs: only the host's work is timed."""

    def __init__(self, name, outputs):
        self.name, self.outputs = name, outputs
        types = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in outputs.items()}
        self.interfaces = {"infer": {"inputs": {}, "outputs": types, "states": {}}}

    def make_state(self):
        return None

    def predict(self, function, inputs, state):
        return self.outputs


# -- structured output ------------------------------------------------------------------------------

SCRIPTS = {  # characters a token is drawn from, its share of the vocabulary, and whether it may start with a space
    "latin": ("etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLC", 0.55, True),
    "accented": ("àáâäçèéêëìíîïñòóôöùúûüßœæøå", 0.05, True),
    "cyrillic": ("".join(map(chr, range(0x430, 0x450))), 0.10, True),
    "cjk": ("".join(map(chr, range(0x4E00, 0x5200))), 0.15, False),
    "code": ("0123456789\"{}[]:,.;()<>/\\=+-*#@!?_'`", 0.10, False),
    "space": (" \n\t", 0.05, False),
}


def text_tokenizer(path: Path, vocab_size: int) -> Path:
    """A tokenizer.json of `vocab_size` ids: the tiny tokenizer's control tokens and bytes, then distinct
    random words of 1-10 characters in the mix of SCRIPTS (no merges: only its token bytes matter)."""
    config = json.loads(build_tokenizer(MIN_VOCAB_SIZE).to_str())
    vocab, rng = config["model"]["vocab"], np.random.default_rng(0)
    to_symbols = {b: s for b, s in enumerate(byte_symbols())}
    while len(vocab) < vocab_size:
        for chars, share, spaced in SCRIPTS.values():
            n = int(share * (vocab_size - len(vocab))) + 1
            picks, lengths = rng.integers(0, len(chars), (n, 10)), rng.integers(1, 11, n)
            space = rng.random(n) < (0.5 if spaced else 0.0)
            for row, length, sp in zip(picks, lengths, space):
                word = (" " if sp else "") + "".join(chars[i] for i in row[:length])
                symbols = word.encode().decode("latin-1").translate(to_symbols)
                if len(vocab) < vocab_size:
                    vocab.setdefault(symbols, len(vocab))
    path.write_text(json.dumps(config, ensure_ascii=False))
    return path


PERSON = {
    "name": "Ada Lovelace",
    "born": 1815,
    "languages": ["English", "French"],
    "address": {"city": "London", "street": "12 St James's Square"},
    "active": True,
    "score": 98.5,
    "note": None,
    "kind": "person",
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "born": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "street": {"type": "string"}},
            "required": ["city", "street"],
        },
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "note": {"type": ["string", "null"]},
        "kind": {"enum": ["person", "organisation"]},
    },
    "required": ["name", "born", "languages", "address", "active", "score", "note", "kind"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
CASES = {  # grammar, and an output it accepts: text, or a control token's id
    "any JSON object": (lambda: response_grammar({"type": "json_object"}), [json.dumps(PERSON, indent=2)]),
    "8-field schema": (
        lambda: response_grammar({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}),
        [json.dumps(PERSON)],
    ),
    "forced tool call": (
        lambda: tool_call_grammar([WEATHER], "get_weather"),
        [TOOL_CALL_OPEN, "call:get_weather{city:", STRING_DELIM, "Paris, France", STRING_DELIM, ",days:3,unit:"]
        + [STRING_DELIM, "celsius", STRING_DELIM, "}", TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN],
    ),
}
STOPS = (EOS, TURN_CLOSE)


def script(constraint: Constraint, parts: list) -> list[int]:
    """The ids of `parts` as the grammar takes them: a text's longest token first, or, where llguidance
    insists on the tokenizer's own split (text the grammar forces), that."""
    lltok, ids = constraint.tokenizer, []
    for part in parts:
        rest = part.encode() if isinstance(part, str) else b""
        while rest:
            token = lltok.greedy_tokenize(rest.decode())[0]
            if not constraint.allowed()[token]:
                token = lltok.tokenize_bytes(rest)[0]
            ids.append(token)
            constraint.advance(token)
            rest = rest[len(lltok.decode_bytes([token])) :]
        if isinstance(part, int):
            ids.append(part)
            constraint.advance(part)
    assert constraint.done
    return ids


def grammar_costs(d: dict, tokens: int, root: Path) -> str:
    """Per-token cost of mask + advance for each of CASES, over `d`'s vocabulary size."""
    V = d["vocab_size"]
    path = text_tokenizer(root / "tokenizer.json", V)
    t = time.perf_counter()
    Constraint(CASES["any JSON object"][0](), path, V, STOPS)  # builds and caches the tokenizer
    build = time.perf_counter() - t
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal(V) * 2.0 + np.where(rng.random(V) < 0.001, 12.0, 0.0)).astype(np.float16)
    rows = []
    for name, (grammar, parts) in CASES.items():
        grammar = grammar()
        ids = script(Constraint(grammar, path, V, STOPS), parts) + [EOS]
        compile_s, steps = [], []
        for _ in range(max(1, tokens // len(ids))):
            t = time.perf_counter()
            constraint = Constraint(grammar, path, V, STOPS)
            compile_s.append(time.perf_counter() - t)
            sampler = Sampler(SamplingParams(temperature=1.0, top_k=64, top_p=0.95, seed=0))
            for token in ids:
                t0 = time.perf_counter()
                masked = constraint.mask(logits)
                t1 = time.perf_counter()
                constraint.advance(token)
                t2 = time.perf_counter()
                sampler.sample(masked)
                steps.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        mask, advance, sample = np.array(steps).T * 1e6
        both = mask + advance
        rows.append(
            f"| {name} | {len(ids)} | {np.median(compile_s) * 1e3:.1f} ms | {mask.mean():.0f} | "
            f"{np.percentile(mask, 99):.0f} | {advance.mean():.0f} | **{both.mean():.0f}** | "
            f"{np.percentile(both, 99):.0f} | {'met' if both.mean() <= 1000 else 'missed'} | {sample.mean():.0f} |"
        )
    return "\n".join(
        [
            f"Structured output (runtime/grammar.py, llguidance {version('llguidance')}): vocabulary of {V} tokens, "
            "nearly all text; per token, in microseconds",
            "",
            f"- tokenizer build for the grammar engine, once per bundle: {build:.2f} s",
            "",
            "| grammar | tokens | compile per request | mask mean | mask p99 | advance mean | mask + advance mean "
            "| p99 | <= 1 ms mean | top-k 64 + top-p draw from the masked logits, mean |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument("--dir", help="where to write the sidecars (default: a temporary directory)")
    p.add_argument("--logprobs", action="store_true", help="also compute the chosen token's logprob")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    d = QUICK if a.quick else E2B
    if a.dir:
        Path(a.dir).mkdir(parents=True, exist_ok=True)  # --dir names where to put them, existing or not
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        config = write_sidecars(root, d)
        rss_before = rss_mb()
        host = load_host(root, config)
        H, PL, V = d["hidden_size"], d["num_hidden_layers"] * d["per_layer_dim"], d["vocab_size"]
        rng = np.random.default_rng(1)
        # a peaked, LLM-like distribution: most mass on a few hundred tokens
        logits = (rng.standard_normal(V) * 2.0 + np.where(rng.random(V) < 0.001, 12.0, 0.0)).astype(np.float16)
        chunks = [
            Instant(
                "chunk_1",
                {
                    "hidden_states_out": np.zeros((1, 1, H), np.float16),
                    "per_layer_combined_out": np.zeros((1, 1, PL), np.float16),
                },
            ),
            Instant("chunk_2", {"hidden_states_out": np.zeros((1, 1, H), np.float16)}),
            Instant("chunk_3", {"logits": logits.reshape(1, 1, V)}),
        ]
        # logits_dtype=None as the runtime: the sampler reads fp16
        engine = Engine(chunks, host, context=d["context"], window=d["window"], prefill_batch=None, logits_dtype=None)
        sampler = Sampler(
            SamplingParams(temperature=1.0, top_k=64, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5, seed=0),
            history=rng.integers(0, V, 32),
        )
        token = 0
        times = []
        n = min(a.tokens, d["context"] - 1)
        for _ in range(n):
            t = time.perf_counter()
            out = engine.feed([token])[-1]
            token = sampler.sample(out)
            if a.logprobs:
                sampler.logprobs(out, token)
            sampler.observe(token)
            times.append(time.perf_counter() - t)
        rss_after = rss_mb()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        grammar = grammar_costs(d, a.tokens, Path(tmp))
    ms = np.array(times) * 1000
    table = "\n".join(
        [
            f"{'quick tables' if a.quick else 'E2B-size sidecars (2.7 GB, rows read with pread)'}, "
            f"{n} decoded tokens, vocab {V}, "
            "top-k 64 + top-p 0.95 + repetition/presence penalties" + (" + logprob" if a.logprobs else ""),
            "",
            f"- host overhead per token: median **{np.median(ms):.3f} ms**, p99 {np.percentile(ms, 99):.3f} ms "
            f"(target <= 1 ms median: {'met' if np.median(ms) <= 1.0 else 'missed'})",
            f"- resident memory: {rss_before:.0f} MB before loading the tables, {rss_after:.0f} MB after {n} tokens",
            "",
            grammar,
        ]
    )
    publish("host overhead per decoded token", table, a)


if __name__ == "__main__":
    main()
