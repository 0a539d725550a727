"""The benchmark scripts' --quick modes, so they cannot rot (the real runs are not CI's job)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # every test here converts a bundle or runs a pipeline

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run(script, *args):
    r = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_palettizer_quick():
    out = run("palettizer.py")
    assert "speed-up" in out and "| wide | 512x1536 |" in out


def test_executor_profile_quick(tiny_bundle4):
    out = run("executor.py", tiny_bundle4)
    assert "matmul share of the step" in out


def test_host_overhead_quick():
    out = run("host_overhead.py")
    assert "host overhead per token: median" in out and "resident memory" in out


def test_drafter_head_quick():
    out = run("drafter_head.py")  # the three ways agree on every logit before they are timed
    assert "| cluster order, einsum (the runtime's) |" in out and "| token order, one read per token |" in out


def test_server_load_quick(tiny_bundle16):
    out = run("server_load.py", tiny_bundle16, "--backend", "mil")
    assert "| 20/20 |" in out and "p99 latency" in out


# -- the full-size pipeline at toy widths: checkpoint -> convert -> cost model -> executor vs HF ----


def script(name, *args, check=True):
    r = subprocess.run(
        [sys.executable, str(BENCH / name), *map(str, args)], capture_output=True, text=True, timeout=900
    )
    if check:
        assert r.returncode == 0, r.stderr[-2000:]
    return r


@pytest.fixture(scope="module")
def quick_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "ckpt"
    script("make_full_checkpoint.py", out, "--quick")
    return out


@pytest.fixture(scope="module")
def quick_bundle(quick_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "bundle4"
    r = script("convert_full.py", quick_ckpt, out, "--quick")
    return out, r


def test_full_checkpoint_layout_is_what_transformers_loads(quick_ckpt):
    import torch
    from transformers import Gemma4ForConditionalGeneration

    index = json.loads((quick_ckpt / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((quick_ckpt / s).is_file() for s in shards)
    assert all(k.startswith("model.language_model.") for k in index["weight_map"])
    model, info = Gemma4ForConditionalGeneration.from_pretrained(
        quick_ckpt, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not [k for k in info["missing_keys"] if "language_model" in k], info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    lm = model.model.language_model
    # realistic scales: norms around 1, projections with std in 0.02-0.05, layer scalars below 1
    norm = lm.layers[0].input_layernorm.weight.float()
    assert 0.75 < norm.min() and norm.max() < 1.25
    std = lm.layers[1].mlp.up_proj.weight.float().std().item()
    assert 0.02 <= std <= 0.05, std
    assert all(0.25 < float(layer.layer_scalar) < 1.0 for layer in lm.layers)


def test_bf16_rounding_matches_torch():
    import torch

    sys.path.insert(0, str(BENCH))
    from make_full_checkpoint import bf16_bytes

    x = np.random.default_rng(0).standard_normal(100000).astype(np.float32) * 0.03
    x[:4] = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 65504.0]  # ties to even, both ways
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert bf16_bytes(x) == want


def test_convert_full_quick(quick_bundle):
    out, r = quick_bundle
    assert "| convert |" in r.stdout and "peak RSS" in r.stdout
    # the converter's own progress bar only: no coremltools pass-pipeline bars
    assert "Running MIL" not in r.stderr and "Converting PyTorch" not in r.stderr, r.stderr[-500:]
    assert (out / "manifest.json").is_file()


def test_cost_model_quick(quick_bundle):
    out, _ = quick_bundle
    report = json.loads(
        subprocess.run(
            [sys.executable, "-m", "gemma_ane.cli", "inspect", str(out), "--json"], capture_output=True, text=True
        ).stdout
    )
    model = json.loads(script("cost_model.py", out, "--json").stdout)
    infer = [c["functions"]["infer"] for c in report["chunks"]]
    assert model["decode"]["weight_bytes"] == sum(f["weight_bytes"] for f in infer)
    assert model["decode"]["macs"] == sum(f["macs_per_token"] for f in infer)
    static, ideal = model["decode"]["kv_static"], model["decode"]["kv_ideal"]
    assert static["256"] == static["2048"] and ideal["256"] < ideal["2048"] <= static["2048"]
    table = script("cost_model.py", out).stdout
    assert "upper bounds" in table and "A19 Pro" in table and "33.4 tok/s" in table
    assert "speculative" not in model and "Speculative" not in table  # no drafter: the output as it was


@pytest.fixture(scope="module")
def drafter_bundle(e2b_full16):
    """A tiny target with its drafter, K = 3 drafts a verify call: conftest's e2b_full16 (converted once a run;
    test_drafter, test_nchunks and test_byte_identity read it too)."""
    return e2b_full16


def test_inspect_reports_the_drafter(drafter_bundle):
    from gemma_ane.files import tree_size

    r = subprocess.run(
        [sys.executable, "-m", "gemma_ane.cli", "inspect", str(drafter_bundle), "--json"],
        capture_output=True,
        text=True,
    )
    report = json.loads(r.stdout)
    drafter = report["assistant"]
    assert drafter["size_bytes"] == tree_size(drafter_bundle / "assistant.mlpackage") > 0
    draft = drafter["functions"]["draft"]
    assert draft["tokens_per_call"] == 1 and draft["weight_bytes"] > 0 and draft["macs_per_token"] > 0
    assert "verify_b4" not in report["prompt_paths"] and "infer" in report["prompt_paths"]  # verify is no prompt path
    text = subprocess.run(
        [sys.executable, "-m", "gemma_ane.cli", "inspect", str(drafter_bundle), "--no-sha"],
        capture_output=True,
        text=True,
    ).stdout
    assert "assistant (assistant.mlpackage)" in text and "  draft: T=1, weights" in text


def test_cost_model_speculative_quick(drafter_bundle):
    sys.path.insert(0, str(BENCH))
    from cost_model import BANDWIDTH, RATES, expected_tokens

    m = json.loads(script("cost_model.py", drafter_bundle, "--json").stdout)
    s, d = m["speculative"], m["decode"]
    draft, verify = s["draft"], s["verify"]
    assert s["built_draft_tokens"] == 3 and verify["function"] == "verify_b4"
    assert draft["weight_bytes"] > 0 and draft["kv_bytes"] > 0 and draft["host_head_macs"] > 0
    assert verify["weight_bytes"] >= d["weight_bytes"] and verify["macs_per_row"] >= d["macs"]
    assert s["plain_bytes"] == d["weight_bytes"] + d["kv_static"]["1024"]
    assert list(s["steps"]) == ["1", "2", "3", "4"]  # K past the bundle's 3 modelled too
    for k, st in s["steps"].items():
        k = int(k)
        assert (
            st["bytes"] == k * (draft["weight_bytes"] + draft["kv_bytes"]) + verify["weight_bytes"] + verify["kv_bytes"]
        )
        assert st["macs"] == k * draft["macs"] + (k + 1) * verify["macs_per_row"]
        tokens = list(st["tokens_per_step"].values())
        assert tokens == pytest.approx([(1 - a ** (k + 1)) / (1 - a) for a in RATES])
        assert 1 < tokens[0] and all(x < y for x, y in zip(tokens, tokens[1:])) and tokens[-1] < k + 1
        for dev, bw in BANDWIDTH.items():
            # bound = tokens x bandwidth / bytes per step: at a = 0 (one token a step) it is below plain decode's
            floor = bw * 1e9 / st["bytes"]
            assert list(st["bound"][dev].values()) == pytest.approx([t * floor for t in tokens])
            assert floor < s["plain_bound"][dev] == pytest.approx(bw * 1e9 / s["plain_bytes"])
    for k in (1, 4):  # the endpoints: nothing accepted gives the target's one token, everything K + 1
        assert expected_tokens(0.0, k) == 1 and expected_tokens(1.0, k) == k + 1
    table = script("cost_model.py", drafter_bundle).stdout
    assert "| draft step (assistant `draft`) |" in table and "`verify_b4`" in table
    assert "| A19 Pro | ≤ " in table and "| 3 (built) |" in table and "assumptions" in table


def test_executor_vs_transformers_quick(quick_ckpt, quick_bundle):
    out, _ = quick_bundle
    r = script("executor_vs_transformers.py", quick_ckpt, "--bundle4", out, "--quick")
    assert "| executor, 4-bit bundle |" in r.stdout and "| transformers bf16 |" in r.stdout
    assert "executor 4-bit decode / transformers bf16 decode" in r.stdout


def test_ane_bench_says_it_needs_macos():
    r = script("ane.py", "some-bundle", check=False)
    assert r.returncode == 2 and "needs macOS" in r.stderr and r.stdout == ""


def test_ane_bench_quick_through_the_core_ml_standin(tiny_bundle16, capsys):
    """The Mac benchmark end to end through coremltools' own front-end (native layer: the tests'
    stand-in), so it cannot arrive on a Mac broken. Its figures mean nothing here."""
    from coreml_standin import PLATFORM_MODULES, install

    sys.path.insert(0, str(BENCH))
    try:
        import ane

        with install(platform_modules=(*PLATFORM_MODULES, "ane")) as standin:
            assert ane.main([str(tiny_bundle16), "--quick"]) == 0
    finally:
        sys.path.remove(str(BENCH))
    out = capsys.readouterr().out
    assert "QUICK MODE" in out and "n/a (no libproc)" in out
    for path in ("| infer |", "| prefill_b8 |", "| prefill_kv_b8 (+ smaller) |", "| 32 |", "| 64 |"):
        assert path in out, path
    # every segment of the soak replays the same steps: on one executor, drift is exactly zero
    assert "soak: 200/200 steps, max logits drift between segments 0\n" in out + "\n"
    assert {f for _, _, f in standin.loads} == {"infer", "prefill_b8", "prefill_kv_b8"}


def test_chat_reuse_quick(tiny_bundle16):
    """The table's shape and arithmetic on a chat that wraps the ring (window 16), and the goal:
    each turn processes only its new tokens, before and after the wrap."""
    out = run("chat_reuse.py", "--bundle", tiny_bundle16, "--backend", "mil")
    assert "window 16, context 128" in out and "answers equal in both passes:" in out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    header, turns, total = rows[0], rows[1:-1], rows[-1]
    assert len(header) == 10 and header[0] == "turn" and [r[0] for r in turns] == ["1", "2", "3", "4"]
    assert total[0] == "total"
    num = [[int(c) for c in r[1:6] + r[7:9]] for r in turns]
    for prompt, new, answer, reused, processed, reused0, processed0 in num:
        assert processed == prompt - reused and 0 <= reused < prompt
        assert reused0 == 0 and processed0 == prompt  # the caches were emptied before each turn
        assert 0 < new == processed and 0 < answer <= 6  # only what was never cached is processed
    assert num[0][1] == num[0][0] and all(r[1] < r[0] for r in num[1:])  # later turns extend earlier ones
    assert all(a[0] < b[0] for a, b in zip(num, num[1:])) and num[-1][0] > 16  # the conversation grows past the window
    assert [int(c) for c in total[1:6] + total[7:9]] == [sum(c) for c in zip(*num)]
    assert all(float(r[i].removesuffix(" s")) > 0 for r in turns for i in (6, 9))


def test_ane_audit_quick(tiny_bundle16):
    out = run("ane_audit.py", tiny_bundle16)
    assert "inspect" in out and "**pass**" in out and "Neural Engine audit: pass" in out
    # tiny_bundle16's rings: chunk_1 and chunk_2 each (8, 1, 16, 64) fp16
    assert "- ring snapshot (every `kv_cache_sliding` state): 0.033 MB" in out


def test_soak_quick(tiny_bundle16):
    """300 greedy steps across a 128-token context (the caches reset as it fills), twice: memory
    flat and the fresh run's tokens and last logits equal the first's."""
    out = run("soak.py", "--bundle", tiny_bundle16)
    assert "memory flat: yes" in out and "output identical to a fresh run: yes (300 tokens, 300 equal;" in out
    assert int(out.split(" greedy decode steps in ")[1].split()[0]) > 1  # the run crossed the context
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == list(range(25, 301, 25))


def test_swift_host_quick():
    out = run("swift_host.py")
    assert "Swift host work per decoded token" in out and "| greedy |" in out and "NO |" not in out
