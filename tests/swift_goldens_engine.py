"""Golden vectors for the Swift package's engine side (swift/Sources/GemmaANE/{Bundle,Host,Engine}), written by the
Python package itself: `python tests/swift_goldens_engine.py OUTDIR`. The Swift tests run this at their start and
compare against what it writes; nothing here is committed output.

OUTDIR/host/: the host half of a bundle (model_config.json, the int8 tables and their scales, RoPE tables, the test
tokenizer with Gemma 4's control token ids) with random rows, shapes unlike any real model's. OUTDIR/engine.json:
- "embed": host rows as `tables.load_host(...).embed` reads them (float32), "rope": RoPE rows, "masks": the three
  masks of CONTRACT §3 over a range of positions, batch sizes, windows and rings;
- "configs": model_config.json variants and the one-line error `schema.read_model_config` gives for each (or null);
- "plans": `Engine.plan` over geometries and positions;
- "sessions": sequences of prompts and decode steps driven through the real `Engine` over stub chunks (below), and
  after each: the tokens it reused, the steps it ran, its position and ring_top, and the ring's contents.

The stub chunks (the Swift tests have the same): chunk_1 is stateful and writes, for each row t of a call at
position p0, the row's hidden_states[0, t, 0] into slot (p0 + t) mod ring of its ring and slot p0 + t of its full
cache; chunk_2 is stateless and returns zero logits. What the engine reuses, rewinds and restores from a snapshot is
then visible in the ring's contents.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from gemma_ane.bundle import layout
from gemma_ane.bundle.errors import BundleError
from gemma_ane.bundle.host import full_mask, kv_sliding_mask, quantize_rows, sliding_mask
from gemma_ane.bundle.schema import read_model_config
from gemma_ane.bundle.tables import load_host, save_npy
from gemma_ane.oracle.tokenizer_files import MIN_VOCAB_SIZE, build_tokenizer
from gemma_ane.runtime.engine import Engine
from gemma_ane.runtime.ladder import ladder_of

V, H, LAYERS, P, ROWS = MIN_VOCAB_SIZE, 12, 3, 4, 96  # vocabulary (the test tokenizer's least), hidden, ...
D_SLIDING, D_FULL = 8, 16

CONFIG = {
    "model_name": "goldens",
    "architecture": "gemma4",
    "hidden_size": H,
    "num_hidden_layers": LAYERS,
    "vocab_size": V,
    "context_length": 64,
    "sliding_window": 16,
    "per_layer_dim": P,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "embed_scale": H**0.5,
    "per_layer_embed_scale": P**0.5,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "quantization": "none",
    "prefill_batch": 4,
    "split": [1, 2],
    "head": "logits",
}

# (what changes, the value): each a model_config.json the schema reads (error null) or refuses in one line
CONFIG_CASES = [
    ({}, None),
    ({"vocab_size": -1}, None),
    ({"vocab_size": True}, None),
    ({"hidden_size": 1.5}, None),
    ({"embed_scale": 0}, None),
    ({"embed_scale": 1e39}, None),
    ({"per_layer_embed_scale": "16"}, None),
    ({"eos_token_id": V}, None),
    ({"bos_token_id": -2}, None),
    ({"layer_types": ["sliding_attention"]}, None),
    ({"layer_types": "full"}, None),
    ({"sliding_window": 0}, None),
    ({"context_length": 2**21}, None),
    # a context ladder's rungs (CONTRACT §3a): sound, out of order, not multiples of 32, one alone, a top that is not
    # the context_length
    ({"contexts": [32, 64]}, None),
    ({"contexts": [64, 32]}, None),
    ({"contexts": [32, 48, 64]}, None),
    ({"contexts": [64]}, None),
    ({"contexts": [32, 128]}, None),
    ({"split": [2, 1]}, None),
    ({"split": [1, 9]}, None),
    ({"head": "argmax"}, None),
    ({"quantization": "int9"}, None),
    ({"final_logit_softcapping": None}, None),
    ({"rms_norm_eps": -1e-6}, None),
    ({"chunks": [{"name": "chunk_1"}]}, None),
    ({"weights": []}, None),
    (None, "per_layer_dim"),  # a required field missing
    (None, "embed_scale"),
]

# masks: (p0, T, window, ring, context)
MASK_CASES = [
    (0, 1, 16, 16, 64),
    (5, 1, 16, 16, 64),
    (15, 1, 16, 16, 64),
    (37, 1, 16, 16, 64),
    (0, 4, 16, 16, 64),
    (12, 4, 16, 16, 64),
    (30, 4, 16, 20, 64),
    (33, 3, 16, 20, 64),
    (0, 8, 8, 8, 32),
    (60, 4, 16, 16, 64),
    (8, 8, 16, 24, 48),
]

# plans: (context, window, ring, prefill_batch, kv_batches, p0, n, logits)
PLAN_CASES = [
    (64, 16, 16, 4, (), 0, 13, "last"),
    (64, 16, 16, 4, (), 0, 30, "last"),
    (64, 16, 16, 4, (), 0, 30, "all"),
    (64, 16, 16, 4, (8, 4), 0, 30, "last"),
    (64, 16, 16, 4, (8, 4), 3, 30, "last"),
    (64, 16, 16, 4, (8, 4), 5, 9, "last"),
    (64, 16, 16, 4, (8, 4), 10, 4, "last"),
    (64, 16, 16, 4, (8, 4), 0, 30, "all"),
    (64, 16, 20, 4, (4,), 17, 25, "last"),
    (64, 16, 20, 5, (), 14, 30, "last"),
    (64, 16, 16, None, (), 0, 9, "last"),
    (64, 16, 16, None, (8,), 0, 64, "last"),
    (512, 128, 128, 8, (64, 8), 0, 300, "last"),
    (512, 128, 128, 8, (64, 8), 77, 300, "last"),
]

# sessions: (geometry, ops); a geometry is (context, window, ring, prefill_batch, kv_batches, verify_batch), an op
# ("prompt", ids, marks) or ("feed", ids)
A = [2, *range(5, 35)]  # 31 tokens
SESSION_CASES = [
    ((64, 16, 16, 4, (8, 4), None), [("prompt", A[:20], []), ("feed", [7, 8]), ("prompt", A[:20] + [7, 8, 9], [])]),
    # past the window the rings lose the old prefix: a snapshot at a mark brings it back
    (
        (64, 16, 16, 4, (8, 4), None),
        [("prompt", A, [12]), ("feed", [3, 4, 5]), ("prompt", A[:12] + [9, 9, 9], []), ("prompt", A[:5], [])],
    ),
    ((64, 16, 16, 4, (), None), [("prompt", A, []), ("prompt", A[:25] + [1, 1], []), ("prompt", [2, 3], [])]),
    # a padded ring (a drafter's) and its reach of one row more
    (
        (64, 16, 20, 4, (4,), 4),
        [("prompt", A, [8, 20]), ("feed", [11, 12]), ("prompt", A[:21] + [4], []), ("prompt", A[:9] + [5], [])],
    ),
    ((32, 8, 8, None, (), None), [("prompt", A[:10], []), ("prompt", A[:10] + [3], []), ("prompt", A[:6], [])]),
    # a context ladder (CONTRACT §3a), its smaller rungs last: climbs mid-feed and mid-prompt carrying the caches,
    # reuses a prefix after a crossing, and starts a fresh session on the smallest rung again
    (
        (64, 16, 16, 4, (8, 4), None, (16, 32)),
        [
            ("prompt", A[:10], []),
            ("feed", [3, 4, 5, 6, 7, 8, 9]),
            ("prompt", A[:10] + [3, 4, 5, 6, 7, 8, 9] + A[12:30], []),
            ("feed", [3] * 20),
            ("prompt", [2, 3], []),
            ("prompt", [9, 9], []),
        ],
    ),
]


class StubChunk:
    """A chunk without a network whose caches record which row went where (see the module's docstring)."""

    def __init__(self, name: str, stateful: bool, geometry):
        context, window, ring, batch, kv, verify, *rungs = geometry
        self.name, self.stateful = name, stateful
        self.interfaces = self.functions(context, ring, batch, kv, verify)
        for c in rungs[0] if rungs else ():  # a ladder's smaller rungs, each function once per rung
            f = self.functions(c, ring, batch, kv, verify)
            self.interfaces |= {f"ctx{c}_{name}": io for name, io in f.items()}

    def functions(self, context, ring, batch, kv, verify) -> dict:
        stateful = self.stateful
        states = (
            {
                "kv_cache_sliding": {"shape": [2, 1, ring, 4], "dtype": "float16"},
                "kv_cache_full": {"shape": [2, 1, context, 4], "dtype": "float16"},
            }
            if stateful
            else {}
        )

        def io(T, mask_width, ple):
            x = {"hidden_states": [1, T, H], "causal_mask_full": [1, 1, T, context]}
            if stateful:
                x |= {"per_layer_raw": [1, T, ple], "causal_mask_sliding": [1, 1, T, mask_width]}
                x |= {"current_pos": [1], "ring_pos": [1]}
                out = {"hidden_states_out": [1, T, H], "per_layer_combined_out": [1, T, ple]}
            else:
                x |= {"per_layer_combined": [1, T, LAYERS * P]}
                out = {"logits": [1, 1, V]}
            types = {n: {"shape": s, "dtype": "int32" if n.endswith("_pos") else "float16"} for n, s in x.items()}
            return {"inputs": types, "outputs": {n: {"shape": s, "dtype": "float16"} for n, s in out.items()}}

        functions = {"infer": io(1, ring, LAYERS * P)}
        if stateful and batch:
            functions[f"prefill_b{batch}"] = io(batch, ring, LAYERS * P)
        for T in kv if stateful else ():
            functions[f"prefill_kv_b{T}"] = io(T, ring + T, 2 * P)
        if verify:
            functions[f"verify_b{verify}"] = io(verify, ring, LAYERS * P)
        return {f: {**x, "states": states} for f, x in functions.items()}

    def load(self, function):
        pass

    def release(self, functions):
        pass

    def make_state(self, function="infer"):
        if not self.stateful:
            return None
        return {n: np.zeros(t["shape"], np.float16) for n, t in self.interfaces[function]["states"].items()}

    def predict(self, function, inputs, state):
        io = self.interfaces[function]
        if not self.stateful:
            return {"logits": np.zeros(io["outputs"]["logits"]["shape"], np.float16)}
        h = np.asarray(inputs["hidden_states"], np.float16)
        p0, ring = int(inputs["current_pos"][0]), state["kv_cache_sliding"].shape[2]
        for t in range(h.shape[1]):
            state["kv_cache_sliding"][0, 0, (p0 + t) % ring, 0] = h[0, t, 0]
            state["kv_cache_full"][0, 0, p0 + t, 0] = h[0, t, 0]
        ple = np.asarray(inputs["per_layer_raw"], np.float16)
        return {"hidden_states_out": h, "per_layer_combined_out": ple}

    def read_state(self, state, name):
        return state[name].copy()

    def write_state(self, state, name, array):
        state[name][...] = array


def write_host(root: Path) -> None:
    rng = np.random.default_rng(7)
    root.mkdir(parents=True, exist_ok=True)
    (root / layout.MODEL_CONFIG).write_text(json.dumps(CONFIG, indent=2))
    for q8, scales, cols in ((layout.EMBED_Q8, layout.EMBED_SCALES, H), (layout.PLE_Q8, layout.PLE_SCALES, LAYERS * P)):
        w = rng.normal(size=(V, cols)).astype(np.float32) * rng.uniform(0.01, 3, size=(V, 1)).astype(np.float32)
        w[3] = 0  # an all-zero row: scale 0
        q, s = quantize_rows(w)
        q.tofile(root / q8)
        s.astype("<f2").tofile(root / scales)
    (root / "hf_model").mkdir(exist_ok=True)
    build_tokenizer(V).save(str(root / layout.HF_TOKENIZER))
    for short, d in (("sliding", D_SLIDING), ("full", D_FULL)):
        for kind in ("cos", "sin"):
            save_npy(root / f"{kind}_{short}.npy", rng.uniform(-1, 1, size=(ROWS, d)).astype(np.float16))


def floats(a) -> list[float]:
    return [float(v) for v in np.asarray(a, np.float32).reshape(-1)]


def config_cases(root: Path) -> list[dict]:
    out, path = [], root / layout.MODEL_CONFIG
    original = path.read_text()
    for change, drop in CONFIG_CASES:
        config = {k: v for k, v in CONFIG.items() if k != drop} | (change or {})
        path.write_text(json.dumps(config))
        try:
            read_model_config(root)
            error = None
        except BundleError as e:
            error = str(e).replace(str(path), "model_config.json")
        out.append({"config": config, "error": error})
    path.write_text(original)
    return out


def sessions(host) -> list[dict]:
    out = []
    for geometry, ops in SESSION_CASES:
        context, window, ring, batch, kv, verify, *rungs = geometry
        chunks = [StubChunk("chunk_1", True, geometry), StubChunk("chunk_2", False, geometry)]
        ladder = ladder_of(chunks)  # as backend.open_engine: a ladder starts on its smallest rung
        if ladder is not None:
            chunks = ladder.chunks(ladder.contexts[0])
        engine = Engine.from_chunks(chunks, host, None, window=window, ladder=ladder)
        results = []
        for op in ops:
            if op[0] == "prompt":
                reused, _ = engine.prompt(op[1], op[2])
            else:
                for t in op[1]:
                    engine.feed([t])
                reused = None
            ring_now = engine.states[0]["kv_cache_sliding"][0, 0, :, 0]
            results.append(
                {
                    "reused": reused,
                    "position": engine.position,
                    "ring_top": engine.ring_top,
                    "history": [[p, f, T] for p, f, T in engine.history],
                    "ring": floats(ring_now),
                    "rung": engine.rung,
                    "crossings": [[c.before, c.after, c.position] for c in engine.crossings],
                    "full": floats(engine.states[0]["kv_cache_full"][0, 0, : engine.position, 0]),
                }
            )
        out.append(
            {
                "geometry": list(geometry[:4]) + [list(kv), verify] + [list(r) for r in rungs],
                "ops": [list(o) for o in ops],
                "after": results,
            }
        )
    return out


def main(outdir: str) -> None:
    out = Path(outdir)
    root = out / "host"
    write_host(root)
    config = read_model_config(root)
    host = load_host(root, config)
    ids = [0, 1, 3, V - 1, 17, 17, 5]
    h, ple = host.embed(np.array(ids))
    goldens = {
        "embed": {"ids": ids, "hidden": floats(h), "ple": floats(ple)},
        "rope": [
            {"type": t, "p0": p0, "count": T, "cos": floats(c), "sin": floats(s)}
            for t in ("sliding_attention", "full_attention")
            for p0, T in ((0, 1), (7, 4), (ROWS - 2, 2))
            for c, s in [host.rope_rows(t, p0, T)]
        ],
        "masks": [
            {
                "p0": p0,
                "count": T,
                "window": w,
                "ring": r,
                "context": c,
                "full": floats(full_mask(p0, T, c)),
                "sliding": floats(sliding_mask(p0, T, w, ring=r)),
                "kv": floats(kv_sliding_mask(p0, T, w, ring=r)),
            }
            for p0, T, w, r, c in MASK_CASES
        ],
        "configs": config_cases(root),
        "plans": [
            {
                "geometry": [c, w, r, b, list(kv)],
                "p0": p0,
                "count": n,
                "all": logits == "all",
                "steps": [[f, T] for f, T in Engine.plan(_Geometry(c, w, r, b, kv), p0, n, logits)],
            }
            for c, w, r, b, kv, p0, n, logits in PLAN_CASES
        ],
        "sessions": sessions(host),
    }
    (out / "engine.json").write_text(json.dumps(goldens))


class _Geometry:
    """What Engine.plan reads of an engine."""

    def __init__(self, context, window, ring, prefill_batch, kv_batches):
        self.context, self.window, self.ring, self.prefill_batch = context, window, ring, prefill_batch
        self.rung = context  # the rung the plan runs on: a single context is its own
        self.kv_batches = tuple(sorted(kv_batches, reverse=True))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/swift_goldens_engine.py OUTDIR")
    main(sys.argv[1])
