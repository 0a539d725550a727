"""Per-token cost of a bundle and the decode speed it allows on Apple silicon: bounds, not measurements.

    python bench/cost_model.py BUNDLE
    python bench/cost_model.py --ladder CONFIG [--contexts 2048,8192,32768]

From `gemma-ane inspect --json BUNDLE` (the saved programs' own weights and ops) and the bundle's
model_config.json:
- decode, per token: multiply-accumulates, weight bytes read (every chunk's `infer`), and KV-cache
  bytes read at a few context lengths;
- each prompt path, per prompt token: MACs and weight bytes;
- decode tok/s upper bounds = ANE bandwidth / bytes per token, for measured ANE bandwidths, beside
  the published figures;
- with a drafter (`convert --assistant`): bytes and MACs per draft step (assistant.mlpackage's
  `draft`) and per verify call (every chunk's `verify_b{K+1}`), and the tok/s bound of speculative
  decoding for assumed acceptance rates and K = 1-4 drafts per step.

Decode on the ANE is bandwidth-bound: each token streams every weight once, and at batch 1 the
MACs per byte (~4 at 4 bits) sit far below what the ANE can compute per byte fetched. The KV
bytes are given twice: as the static-shape programs read them (every cache whole, at any
position: this is what the bundle does) and as a kernel that reads only the valid rows would.

With --ladder, from a checkpoint's config.json alone (the chunk plan, no bundle): the bytes one decoded token
reads at a few positions in a context ladder (bundle.ladder: the smallest rung holding the position runs) against
single-context bundles of its smallest and largest context, each rung's weights, KV and hand-offs as `plan` shows.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import publish  # noqa: E402

from gemma_ane.bundle.plan import ChunkPlan  # noqa: E402
from gemma_ane.bundle.rung_cost import rung_costs  # noqa: E402
from gemma_ane.bundle.spec import ModelSpec  # noqa: E402

# Measured ANE bandwidths (GB/s), from public write-ups; ranges use their midpoint.
BANDWIDTH = {"A17 Pro": 51, "A18 Pro": 60, "A19 Pro": 77, "M1-M2": 58.5, "M3/M4 base": 66.5, "M4 Pro/Max": 120}
PUBLISHED = [
    ("published build, iPhone 17 Pro (A19 Pro), ANE", 33.4),
    ("published build, Mac Studio, ANE", 34.6),
    ("LiteRT-LM, iPhone 17 Pro, GPU", 56.0),
]
CONTEXTS = (256, 1024, 2048)
RATES = (0.3, 0.5, 0.7, 0.9)  # assumed per-draft acceptance: random weights give no real one
DRAFTS = (1, 2, 3, 4)


def inspect(bundle: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "gemma_ane.cli", "inspect", bundle, "--json", "--no-sha"], capture_output=True, text=True
    )
    if out.returncode not in (0, 1) or not out.stdout.strip():
        why = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"
        sys.exit(f"error: gemma-ane inspect {bundle}: {why}")
    return json.loads(out.stdout)


def kv_bytes(config: dict, n: int, static: bool, ring: int) -> int:
    """KV bytes one decode token reads at context length n (fp16 K and V); static programs read the
    whole ring (`ring` slots: the window, padded in bundles with a drafter). KV-shared layers read
    their producer's cache again: the ANE keeps nothing across ops that large."""
    C, W = config["context_length"], config["sliding_window"]
    total = 0
    for t in config["layer_types"]:
        full = t == "full_attention"
        D = config["global_head_dim"] if full else config["head_dim"]
        rows = (C if full else ring) if static else (min(n, C) if full else min(n, W))
        total += 2 * config["num_key_value_heads"] * rows * D * 2
    return total


def model(report: dict, config: dict) -> dict:
    infer = [c["functions"]["infer"] for c in report["chunks"]]
    ring = next(
        (c["states"]["kv_cache_sliding"]["shape"][2] for c in report["chunks"] if "kv_cache_sliding" in c["states"]),
        config["sliding_window"],
    )
    decode = {"macs": sum(f["macs_per_token"] for f in infer), "weight_bytes": sum(f["weight_bytes"] for f in infer)}
    decode["kv_static"] = {n: kv_bytes(config, n, True, ring) for n in CONTEXTS}
    decode["kv_ideal"] = {n: kv_bytes(config, n, False, ring) for n in CONTEXTS}
    m = {"decode": decode, "prompt_paths": report["prompt_paths"]}
    if "assistant" in report:
        m["speculative"] = speculative(report, config, decode)
    return m


def expected_tokens(a: float, k: int) -> float:
    """Tokens one speculative step emits when each of k drafts is accepted with probability a, independently,
    until the first rejection, plus the target's own token: 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
    return sum(a**i for i in range(k + 1))


def speculative(report: dict, config: dict, decode: dict) -> dict:
    """Bytes and MACs of a draft step and a verify call, and the tok/s bound per K and acceptance rate. A step
    streams the drafter K times and the three chunks once, each with the caches it reads (static, as decode)."""
    built = config["assistant"]["draft_tokens"]
    name = f"verify_b{built + 1}"
    verify = [c["functions"][name] for c in report["chunks"]]
    draft = report["assistant"]["functions"]["draft"]
    head = config["assistant"]
    kv = decode["kv_static"][CONTEXTS[1]]
    per_draft = {
        "weight_bytes": draft["weight_bytes"],
        # the producers' caches as chunk_2 returns them (fp16), each read once
        "kv_bytes": sum(2 * math.prod(t["shape"]) for n, t in draft["inputs"].items() if n.startswith("kv")),
        "macs": draft["macs_per_token"],
        # the centroid head's best clusters dotted with the drafter's hidden state, on the host
        "host_head_macs": head["centroid_top_k"] * config["vocab_size"] // head["num_centroids"] * head["hidden_size"]
        if head["num_centroids"]
        else 0,
    }
    per_verify = {
        "function": name,
        "weight_bytes": sum(f["weight_bytes"] for f in verify),
        "kv_bytes": kv,
        "macs_per_row": sum(f["macs_per_token"] for f in verify),
    }
    plain = decode["weight_bytes"] + kv
    steps = {}
    for k in DRAFTS:  # weights and caches are read once per call whatever its rows: only MACs grow with K
        size = k * (per_draft["weight_bytes"] + per_draft["kv_bytes"]) + per_verify["weight_bytes"] + kv
        tokens = {r: expected_tokens(r, k) for r in RATES}
        steps[k] = {
            "bytes": size,
            "macs": k * per_draft["macs"] + (k + 1) * per_verify["macs_per_row"],
            "tokens_per_step": tokens,
            "bound": {dev: {r: t * bw * 1e9 / size for r, t in tokens.items()} for dev, bw in BANDWIDTH.items()},
        }
    return {
        "built_draft_tokens": built,
        "draft": per_draft,
        "verify": per_verify,
        "plain_bytes": plain,
        "plain_bound": {dev: bw * 1e9 / plain for dev, bw in BANDWIDTH.items()},
        "steps": steps,
    }


def mb(b):
    return f"{b / 1e6:,.1f} MB"


def render(bundle: str, m: dict) -> str:
    d = m["decode"]
    lines = [
        f"Bundle `{bundle}`.",
        "",
        "Decode, per token (chunk_1 + chunk_2 + chunk_3 `infer`):",
        "",
        f"- {d['macs'] / 1e9:.2f} G MACs; weights read {mb(d['weight_bytes'])}",
        "",
    ]
    lines += [
        "| context | KV read (static programs) | KV read (valid rows only) | total bytes/token (static) |",
        "|---:|---:|---:|---:|",
    ]
    for n in CONTEXTS:
        lines.append(
            f"| {n} | {mb(d['kv_static'][n])} | {mb(d['kv_ideal'][n])} | {mb(d['weight_bytes'] + d['kv_static'][n])} |"
        )
    lines += [
        "",
        "Prompt processing, per prompt token (chunk_1 + chunk_2; chunk_3 runs once per prompt):",
        "",
        "| path | tokens/call | MACs/token | weight bytes/token |",
        "|---|---:|---:|---:|",
    ]
    base = m["prompt_paths"].get("prefill_b8")
    for name, p in m["prompt_paths"].items():
        rel = (
            f" ({p['macs_per_prompt_token'] / base['macs_per_prompt_token']:.0%} / "
            f"{p['weight_bytes_per_prompt_token'] / base['weight_bytes_per_prompt_token']:.1%} of prefill_b8)"
            if base and name != "prefill_b8"
            else ""
        )
        lines.append(
            f"| {name}{rel} | {p['tokens_per_call']} | {p['macs_per_prompt_token'] / 1e9:.3f} G | "
            f"{mb(p['weight_bytes_per_prompt_token'])} |"
        )
    per_token = d["weight_bytes"] + d["kv_static"][CONTEXTS[1]]
    lines += [
        "",
        f"Decode tok/s **upper bounds** at context {CONTEXTS[1]} = ANE bandwidth / "
        f"{mb(per_token)} per token (weights + static KV). Bounds, not measurements: real decode also "
        "pays op dispatch, the three chunk hand-offs and host work.",
        "",
        "| device | ANE bandwidth | bound |",
        "|---|---:|---:|",
    ]
    for dev, bw in BANDWIDTH.items():
        lines.append(f"| {dev} | {bw} GB/s | ≤ {bw * 1e9 / per_token:.1f} tok/s |")
    if "speculative" in m:
        lines += render_speculative(m["speculative"], d)
    lines += ["", "Published measurements, for comparison:", ""]
    lines += [f"- {name}: {tps} tok/s" for name, tps in PUBLISHED]
    return "\n".join(lines)


def render_speculative(s: dict, d: dict) -> list[str]:
    dr, v, K = s["draft"], s["verify"], s["built_draft_tokens"]

    lines = [
        "",
        f"Speculative decoding with the bundle's drafter (built for K = {K}: `{v['function']}`), per call:",
        "",
        "| call | weights read | KV read (static, context 1024) | MACs |",
        "|---|---:|---:|---:|",
        f"| plain decode step (`infer`) | {mb(d['weight_bytes'])} | {mb(d['kv_static'][CONTEXTS[1]])} | "
        f"{d['macs'] / 1e9:.3f} G |",
        f"| draft step (assistant `draft`) | {mb(dr['weight_bytes'])} | {mb(dr['kv_bytes'])} | "
        f"{dr['macs'] / 1e9:.3f} G |",
        f"| verify call (chunk_1 + chunk_2 + chunk_3 `{v['function']}`) | {mb(v['weight_bytes'])} | "
        f"{mb(v['kv_bytes'])} | {(K + 1) * v['macs_per_row'] / 1e9:.3f} G ({v['macs_per_row'] / 1e9:.3f} G/row) |",
        "",
        f"Plus, per draft step on the host, not in the bounds: the centroid head's {dr['host_head_macs']:,} MACs "
        "(the best clusters' int8 rows of the drafter's embedding, one byte a MAC, dotted with its hidden state).",
        "",
        "A step of K drafts: K draft calls and one verify call, so the ANE reads K x draft + verify bytes "
        "(weights and caches once per call, whatever its rows); with each draft accepted with probability a, "
        "independently, it emits (1 - a^(K+1)) / (1 - a) tokens. The bundle runs K = "
        f"{K}; the other K are modelled the same way, from the per-row costs (a bundle converted with "
        "`--draft-tokens K`). The acceptance rates are assumptions, not measurements: a bundle of random "
        "weights has no meaningful rate, and a real drafter's must be measured on text. The bound is "
        "bandwidth-bound like plain decode's and ignores the host (drafting, the head, sampling) and "
        "dispatch; CoreML-LLM measured a 3-token verify at 52 ms against 35 ms for a decode step on "
        "iPhone 17 Pro, which this model does not capture.",
        "",
        "Tokens per step, and in brackets the bound's gain over plain decode (the same on every device):",
        "",
        "| K | bytes/step | MACs/step | " + " | ".join(f"a = {r}" for r in RATES) + " |",
        "|---:|---:|---:|" + "---:|" * len(RATES),
    ]
    for k, st in s["steps"].items():
        gain = s["plain_bytes"] / st["bytes"]
        tokens = " | ".join(f"{t:.2f} (×{t * gain:.2f})" for t in st["tokens_per_step"].values())
        lines.append(f"| {k} | {mb(st['bytes'])} | {st['macs'] / 1e9:.2f} G | {tokens} |")
    lines += [
        "",
        "Speculative decode tok/s **upper bounds** per device, beside plain decode's:",
        "",
        "| device | plain decode | K | " + " | ".join(f"a = {r}" for r in RATES) + " |",
        "|---|---:|---:|" + "---:|" * len(RATES),
    ]
    for dev, plain in s["plain_bound"].items():
        for k, st in s["steps"].items():
            bounds = " | ".join(f"≤ {b:.1f}" for b in st["bound"][dev].values())
            lines.append(f"| {dev} | ≤ {plain:.1f} | {k}{' (built)' if k == K else ''} | {bounds} |")
    return lines


LADDER = (2048, 8192, 32768)
POSITIONS = (1000, 6000, 30000)


def ladder_table(config: dict, contexts=LADDER, positions=POSITIONS, bits: int = 4) -> list[dict]:
    """Per position: bytes per decoded token of the ladder (on the smallest rung holding the position) and of
    single-context bundles of its smallest and largest context (None where the position does not fit)."""
    spec = ModelSpec.from_config(config)
    ladder = {c["context"]: c for c in rung_costs(ChunkPlan.build(spec, contexts[-1], contexts=contexts), bits)}
    alone = {C: rung_costs(ChunkPlan.build(spec, C), bits)[0] for C in (contexts[0], contexts[-1])}
    rows = []
    for p in positions:
        rung = next(C for C in contexts if C > p)
        row = {"position": p, "rung": rung, "ladder": ladder[rung]["bytes_per_token"], "parts": ladder[rung]}
        row.update({f"{C} only": a["bytes_per_token"] if p < C else None for C, a in alone.items()})
        rows.append(row)
    return rows


def render_ladder(name: str, contexts, rows: list[dict]) -> str:
    small, large = f"{contexts[0]} only", f"{contexts[-1]} only"
    lines = [
        f"`{name}`, ladder {' / '.join(map(str, contexts))} (4-bit weights): bytes one decoded token reads "
        "(weights + KV + hand-offs), from the plan:",
        "",
        f"| position | rung | ladder | {small} | {large} | ladder / {small} | ladder / {large} |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r['ladder'] / r[small]:.3f}" if r[small] else "-"
        lines.append(
            f"| {r['position']:,} | {r['rung']} | {mb(r['ladder'])} | {mb(r[small]) if r[small] else 'does not fit'} "
            f"| {mb(r[large])} | {ratio} | {r['ladder'] / r[large]:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", nargs="?")
    p.add_argument("--ladder", metavar="CONFIG", help="a checkpoint's config.json: the context ladder's table instead")
    p.add_argument("--contexts", default=",".join(map(str, LADDER)), help="the ladder's rungs (with --ladder)")
    p.add_argument("--json", action="store_true", help="print the model as JSON instead of tables")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    if a.ladder:
        contexts = tuple(int(c) for c in a.contexts.split(","))
        rows = ladder_table(json.loads(Path(a.ladder).read_text()), contexts)
        if a.json:
            print(json.dumps(rows, indent=2))
            return
        publish("context ladder cost", render_ladder(a.ladder, contexts, rows), a)
        return
    if a.bundle is None:
        p.error("give a BUNDLE, or --ladder CONFIG")
    config_path = Path(a.bundle) / "model_config.json"
    if not config_path.is_file():
        sys.exit(f"error: {config_path}: missing (not a gemma-ane bundle?)")
    report = inspect(a.bundle)
    packages = report["chunks"] + ([report["assistant"]] if "assistant" in report else [])
    if any(f["weight_bytes"] is None for p in packages for f in p["functions"].values()):
        sys.exit(f"error: {a.bundle}: compiled packages (.mlmodelc) cannot be costed; convert with --no-compile")
    m = model(report, json.loads(config_path.read_text()))
    if a.json:
        print(json.dumps(m, indent=2))
        return
    publish("cost model and decode bounds", render(a.bundle, m), a)


if __name__ == "__main__":
    main()
