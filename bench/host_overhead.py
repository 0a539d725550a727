"""The runtime's host work per decoded token, with chunks that answer instantly.

    python bench/host_overhead.py               # real E2B sizes: 262,144-row int8 sidecars (2.7 GB)
    python bench/host_overhead.py --quick       # small tables, for the test suite

Per token: embedding + PLE row reads (pread) and dequantisation from the sidecars, masks, RoPE rows,
the chunk calls (precomputed outputs), repetition/presence penalties, top-k/top-p sampling over
the whole vocabulary (on chunk_3's fp16 logits, as the runtime does), and with --logprobs the
chosen token's logprob (opt-in in the runtime: a log-sum-exp over the whole vocabulary). Prints
median and p99 per token (target: <= 1 ms median) and the resident memory after the run, which
must not grow with the table size.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402

from gemma_ane.bundle import load_host  # noqa: E402
from gemma_ane.engine import Engine  # noqa: E402
from gemma_ane.sampling import Sampler, SamplingParams  # noqa: E402

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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument("--dir", help="where to write the sidecars (default: a temporary directory)")
    p.add_argument("--logprobs", action="store_true", help="also compute the chosen token's logprob")
    p.add_argument("--no-record", action="store_true")
    a = p.parse_args(argv)
    d = QUICK if a.quick else E2B
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
        ]
    )
    publish("host overhead per decoded token", table, a)


if __name__ == "__main__":
    main()
