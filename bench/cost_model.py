"""Per-token cost of a bundle and the decode speed it allows on Apple silicon: bounds, not measurements.

    python bench/cost_model.py BUNDLE

From `gemma-ane inspect --json BUNDLE` (the saved programs' own weights and ops) and the bundle's
model_config.json:
- decode, per token: multiply-accumulates, weight bytes read (every chunk's `infer`), and KV-cache
  bytes read at a few context lengths;
- each prompt path, per prompt token: MACs and weight bytes;
- decode tok/s upper bounds = ANE bandwidth / bytes per token, for measured ANE bandwidths, beside
  the published figures.

Decode on the ANE is bandwidth-bound: each token streams every weight once, and at batch 1 the
MACs per byte (~4 at 4 bits) sit far below what the ANE can compute per byte fetched. The KV
bytes are given twice: as the static-shape programs read them (every cache whole, at any
position: this is what the bundle does) and as a kernel that reads only the valid rows would.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402

# Measured ANE bandwidths (GB/s), from public write-ups; ranges use their midpoint.
BANDWIDTH = {"A17 Pro": 51, "A18 Pro": 60, "A19 Pro": 77, "M1-M2": 58.5, "M3/M4 base": 66.5, "M4 Pro/Max": 120}
PUBLISHED = [
    ("published build, iPhone 17 Pro (A19 Pro), ANE", 33.4),
    ("published build, Mac Studio, ANE", 34.6),
    ("LiteRT-LM, iPhone 17 Pro, GPU", 56.0),
]
CONTEXTS = (256, 1024, 2048)


def inspect(bundle: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "gemma_ane.cli", "inspect", bundle, "--json", "--no-sha"], capture_output=True, text=True
    )
    if out.returncode not in (0, 1) or not out.stdout.strip():
        why = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"
        sys.exit(f"error: gemma-ane inspect {bundle}: {why}")
    return json.loads(out.stdout)


def kv_bytes(config: dict, n: int, static: bool) -> int:
    """KV bytes one decode token reads at context length n (fp16 K and V). KV-shared layers read
    their producer's cache again: the ANE keeps nothing across ops that large."""
    C, W = config["context_length"], config["sliding_window"]
    total = 0
    for t in config["layer_types"]:
        full = t == "full_attention"
        D = config["global_head_dim"] if full else config["head_dim"]
        rows = (C if full else W) if static else (min(n, C) if full else min(n, W))
        total += 2 * config["num_key_value_heads"] * rows * D * 2
    return total


def model(report: dict, config: dict) -> dict:
    infer = [c["functions"]["infer"] for c in report["chunks"]]
    decode = {"macs": sum(f["macs_per_token"] for f in infer), "weight_bytes": sum(f["weight_bytes"] for f in infer)}
    decode["kv_static"] = {n: kv_bytes(config, n, True) for n in CONTEXTS}
    decode["kv_ideal"] = {n: kv_bytes(config, n, False) for n in CONTEXTS}
    return {"decode": decode, "prompt_paths": report["prompt_paths"]}


def render(bundle: str, m: dict) -> str:
    d = m["decode"]

    def mb(b):
        return f"{b / 1e6:,.1f} MB"

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
    lines += ["", "Published measurements, for comparison:", ""]
    lines += [f"- {name}: {tps} tok/s" for name, tps in PUBLISHED]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--json", action="store_true", help="print the model as JSON instead of tables")
    p.add_argument("--no-record", action="store_true")
    a = p.parse_args(argv)
    config_path = Path(a.bundle) / "model_config.json"
    if not config_path.is_file():
        sys.exit(f"error: {config_path}: missing (not a gemma-ane bundle?)")
    m = model(inspect(a.bundle), json.loads(config_path.read_text()))
    if a.json:
        print(json.dumps(m, indent=2))
        return
    publish("cost model and decode bounds", render(a.bundle, m), a)


if __name__ == "__main__":
    main()
