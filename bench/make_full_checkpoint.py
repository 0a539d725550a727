"""A random Gemma 4 E2B (or E4B) checkpoint at the real size, streamed to disk.

    python bench/make_full_checkpoint.py OUT                # E2B: 35 layers, PLE 262144x8960: 9.3 GB bf16
    python bench/make_full_checkpoint.py OUT --config e4b   # E4B: 42 layers, hidden 2560
    python bench/make_full_checkpoint.py OUT --quick        # E2B's layout at toy widths, for the test suite
    python bench/make_full_checkpoint.py OUT --assistant    # gemma-4-E2B-it-assistant: the 78 M drafter

The real weights cannot be downloaded here, so the benchmarks run on this: the Hub's config.json
of gemma-4-E2B-it (tests/fixtures/e2b_config.json, or e4b_config.json), the multimodal key layout
(`model.language_model.*`, text tower only), bf16 safetensors sharded with an index like the
Hub's. Tensor names and shapes come from transformers' own model built on the meta device, so the
layout is the one transformers loads. Each tensor is generated and written in blocks of rows: the
process never holds more than one block (~64 MB). Scales are those of a trained model: norm weights
around 1, projections with std 0.02-0.05, layer scalars below 1.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, publish  # noqa: E402

from gemma_ane.files import building  # noqa: E402
from gemma_ane.oracle.tiny import checkpoint_dir  # noqa: E402

CONFIGS = {name: ROOT / "tests" / "fixtures" / f"{name}_config.json" for name in ("e2b", "e4b")}
S, F = "sliding_attention", "full_attention"
# E2B's structure (4:1 pattern, one KV head, 256/512 head dims, KV sharing, double-wide MLP, PLE)
# at toy widths and 6 layers: what `--quick` writes so a test can run every bench script.
QUICK = dict(
    vocab_size=512,
    vocab_size_per_layer_input=512,
    hidden_size=64,
    hidden_size_per_layer_input=8,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_kv_shared_layers=2,
    sliding_window=16,
    layer_types=[S, S, F, S, S, F],
)
BLOCK = 16 * 2**20  # values generated at a time


def hub_config(name: str, quick: bool) -> dict:
    config = json.loads(CONFIGS[name].read_text())
    if quick:
        config["text_config"].update(QUICK)
    return config


def text_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every text weight, as transformers' Gemma4ForConditionalGeneration names them."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(Gemma4Config(**config))
    prefix = "model.language_model."
    return {name: tuple(p.shape) for name, p in model.state_dict().items() if name.startswith(prefix)}


def scale_of(name: str) -> tuple[str, float, float]:
    """(distribution, a, b) of one weight: uniform(a, b) or normal(0, a)."""
    if name.endswith("layer_scalar"):
        return "uniform", 0.3, 0.9
    if name.endswith("norm.weight"):
        return "uniform", 0.8, 1.2
    if name.endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight")):
        return "normal", 0.03, 0.0
    return "normal", 0.035, 0.0  # projections: std in the 0.02-0.05 range of trained checkpoints


def bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bfloat16 with round-to-nearest-even, as torch's .to(torch.bfloat16)."""
    u = x.astype(np.float32).view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (u >> np.uint32(16)).astype("<u2").tobytes()


def write_tensor(f, rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> None:
    kind, a, b = scale_of(name)
    n = int(np.prod(shape))
    for start in range(0, n, BLOCK):
        m = min(BLOCK, n - start)
        block = (
            rng.uniform(a, b, m).astype(np.float32)
            if kind == "uniform"
            else rng.standard_normal(m, dtype=np.float32) * np.float32(a)
        )
        f.write(bf16_bytes(block))


def plan_shards(params: dict, shard_bytes: int) -> list[list[str]]:
    """Consecutive names (sorted, as save_pretrained orders them) cut at shard_bytes."""
    shards, size = [[]], 0
    for name in sorted(params):
        nbytes = 2 * int(np.prod(params[name]))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_shard(path: Path, names: list[str], params: dict, rng: np.random.Generator) -> None:
    """safetensors: u64 header length, JSON header (8-byte aligned), then the raw tensors in order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        nbytes = 2 * int(np.prod(params[name]))
        header[name] = {"dtype": "BF16", "shape": list(params[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            write_tensor(f, rng, name, params[name])


def make_checkpoint(out: Path, quick: bool = False, shard_gb: float = 4.0, seed: int = 0, model: str = "e2b") -> dict:
    config = hub_config(model, quick)
    params = text_parameters(config)
    shards = plan_shards(params, int(shard_gb * 1e9) if not quick else 2**18)
    rng = np.random.default_rng(seed)
    with checkpoint_dir(out, config["text_config"]["vocab_size"]) as tmp:
        weight_map = {}
        for k, names in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            write_shard(tmp / fname, names, params, rng)
            weight_map.update({n: fname for n in names})
        total = sum(2 * int(np.prod(s)) for s in params.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"tensors": len(params), "parameters": total // 2, "bytes": total, "shards": len(shards)}


def make_assistant(out: Path, seed: int = 0) -> dict:
    """The drafter at its real size (78 M parameters, one bf16 file), built by transformers from the Hub's
    config.json (tests/fixtures/e2b_assistant_config.json) with the same trained-like scales, and a random
    token_ordering: its head then scores real clusters of a permuted vocabulary, as the published one does."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    config = json.loads((ROOT / "tests" / "fixtures" / "e2b_assistant_config.json").read_text())
    text = Gemma4TextConfig(**config.pop("text_config"))
    config.pop("model_type", None)
    model = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(**config, text_config=text)).eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            kind, a, b = scale_of(name if "centroids" not in name else "embed_tokens.weight")
            n = param.numel()
            x = rng.uniform(a, b, n) if kind == "uniform" else rng.standard_normal(n) * a
            param.copy_(torch.from_numpy(x.astype(np.float32)).view(param.shape))
        order = model.masked_embedding.token_ordering
        order.copy_(torch.from_numpy(rng.permutation(order.numel())))
    model.generation_config.num_assistant_tokens = 4
    with building(out) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)  # floating tensors only: token_ordering stays int64
    total = sum(p.numel() for p in model.parameters())
    return {"tensors": len(model.state_dict()), "parameters": total, "bytes": 2 * total, "shards": 1}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--config", choices=sorted(CONFIGS), default="e2b", help="which model's config (default e2b)")
    p.add_argument("--quick", action="store_true", help="E2B's layout at toy widths, 6 layers (for the test suite)")
    p.add_argument("--assistant", action="store_true", help="E2B's drafter (gemma-4-E2B-it-assistant) instead")
    p.add_argument("--shard-gb", type=float, default=4.0, help="shard size in GB (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.exists() and not a.force:
        sys.exit(f"error: {out}: already exists (use --force to replace it)")
    t0 = time.perf_counter()
    if a.quick and a.config != "e2b":
        sys.exit("error: --quick writes E2B's layout only")
    if a.assistant and (a.quick or a.config != "e2b"):
        sys.exit("error: --assistant writes E2B's drafter only (its config is the one published)")
    info = make_assistant(out, a.seed) if a.assistant else make_checkpoint(out, a.quick, a.shard_gb, a.seed, a.config)
    seconds = time.perf_counter() - t0
    what = "E2B assistant" if a.assistant else "quick (toy widths)" if a.quick else a.config.upper() + " text config"
    body = (
        f"{what}: {info['tensors']} tensors, "
        f"{info['parameters']:,} parameters, {info['bytes'] / 1e9:.2f} GB bf16 in {info['shards']} shards, "
        f"written in {seconds:.0f} s"
    )
    publish("random full-size checkpoint", body, a)


if __name__ == "__main__":
    main()
