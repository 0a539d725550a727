"""Golden vectors for the Swift package's text side (swift/Sources/GemmaANE/{Sampling,Text,ChatFormat}), written by
the Python package itself: `python tests/swift_goldens_text.py OUTDIR`. The Swift tests run this at their start and
compare against what it writes; nothing here is committed output.

OUTDIR/sampling.json: numpy's PCG64 stream for a set of seeds (raw 64-bit outputs, `random()` doubles as bit
patterns), and the Python Sampler's draws per parameter set and seed over logits written beside it (little-endian
float32, fp16 values as the head returns them, `steps` rows of `vocab` each).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

from gemma_ane.runtime.sampling import Sampler, SamplingParams

SEEDS = [0, 1, 7, 42, 2**32 - 1, 2**32, 2**40 + 12345, 2**63 - 1, 2**64 - 1]

# (name, vocab, params, steps, history, bans): every field of the Python sampler and each path of its chain
SAMPLER_CASES = [
    ("greedy", 300, {"temperature": 0.0}, 6, [], []),
    ("plain", 300, {}, 8, [], []),
    ("plain-262144", 262144, {}, 3, [], []),
    ("temperature-top-k", 5000, {"temperature": 0.7, "top_k": 40}, 8, [], []),
    ("top-p", 5000, {"top_p": 0.9}, 8, [], []),
    ("top-p-262144", 262144, {"top_p": 0.8, "temperature": 1.0}, 3, [], []),
    ("top-k-top-p", 5000, {"temperature": 1.3, "top_k": 64, "top_p": 0.8}, 8, [], []),
    ("min-p", 5000, {"min_p": 0.1}, 8, [], []),
    ("min-p-262144", 262144, {"min_p": 0.05, "temperature": 0.9}, 3, [], []),
    ("chain", 5000, {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "min_p": 0.05}, 8, [], []),
    (
        "penalties",
        300,
        {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3, "top_k": 20},
        12,
        [3, 3, 17, 250, 299],
        [],
    ),
    (
        "penalties-262144",
        262144,
        {"repetition_penalty": 1.2, "frequency_penalty": 0.4, "top_k": 64, "top_p": 0.9, "temperature": 0.8},
        4,
        [1, 2, 2, 99_999, 262_143],
        [],
    ),
    ("negative-penalties", 300, {"presence_penalty": -1.5, "frequency_penalty": -0.7, "top_p": 0.7}, 10, [5, 6], []),
    ("logit-bias", 300, {"logit_bias": {7: 100.0, 8: -100.0, 9: 5.5, 10: -3.25}}, 8, [], []),
    ("bans", 300, {"top_k": 10, "logit_bias": {11: 2.0}}, 8, [], [12, 13, 14]),
    ("flat", 300, {"temperature": 1e40, "top_k": 10}, 8, [], []),
    ("greedy-top-k-1-penalised", 300, {"top_k": 1, "repetition_penalty": 2.0}, 6, [0, 1, 2], []),
    ("hot", 300, {"temperature": 2.5, "min_p": 0.02, "top_p": 0.99}, 8, [], []),
]
SAMPLER_SEEDS = [0, 42, 2**64 - 1]


def _logits(vocab: int, steps: int, seed: int) -> np.ndarray:
    """fp16 logits with a peaked head and ties (fp16 rounds many alike), as a head gives them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 2.0, size=(steps, vocab))
    x[:, rng.integers(0, vocab, size=8)] += rng.uniform(4, 12, size=8)
    return x.astype(np.float16)


def _pcg(seed: int) -> dict:
    raw = np.random.default_rng(seed).bit_generator.random_raw(6)
    rng = np.random.default_rng(seed)
    doubles = [struct.unpack("<Q", struct.pack("<d", rng.random()))[0] for _ in range(6)]
    return {"seed": str(seed), "raw": [str(int(v)) for v in raw], "doubles": [str(v) for v in doubles]}


def write_sampling(out: Path) -> None:
    cases = []
    for i, (name, vocab, params, steps, history, bans) in enumerate(SAMPLER_CASES):
        logits = _logits(vocab, steps, 1000 + i)
        file = f"sampling-{name}.bin"
        (out / file).write_bytes(logits.astype("<f4").tobytes())
        for seed in SAMPLER_SEEDS:
            p = SamplingParams(**params, seed=seed if seed < 2**63 else seed - 2**64)
            sampler = Sampler(p, history=history, bans=bans)
            tokens = []
            for row in logits:
                token = sampler.sample(row)
                sampler.observe(token)
                tokens.append(token)
            bias = {str(k): v for k, v in params.get("logit_bias", {}).items()}
            fields = {k: v for k, v in params.items() if k != "logit_bias"}
            cases.append(
                {"name": name, "vocab": vocab, "steps": steps, "params": fields, "logit_bias": bias,
                 "seed": str(seed), "history": history, "bans": bans, "logits": file, "tokens": tokens}
            )  # fmt: skip
    doc = {"pcg": [_pcg(s) for s in SEEDS], "cases": cases}
    (out / "sampling.json").write_text(json.dumps(doc, indent=1))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/swift_goldens_text.py OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    write_sampling(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
