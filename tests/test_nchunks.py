"""Plans of any number of chunks (`--split a,b,c...`, `--max-chunk-mb`): what each chunk owns, takes and hands on,
its weights at the chosen bits, the one-line refusals, and the engine wiring what the plan declares, proved
against transformers (graphs here; converted 4- and 6-chunk bundles, with the drafter and an image, in the slow
tests)."""

import json
from pathlib import Path

import numpy as np
import pytest

from gemma_ane.bundle.plan import ChunkPlan, chunk_weight_bytes, parse_split, split_for_budget
from gemma_ane.bundle.spec import ConfigError, ModelSpec
from gemma_ane.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
E2B, E4B = FIXTURES / "e2b_config.json", FIXTURES / "e4b_config.json"


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# -- plans -------------------------------------------------------------------------------------------------------


def test_four_chunks_hand_the_producer_caches_to_every_later_chunk(e2b_config):
    """8,15,25: chunk_2 owns the producers 13 and 14 and hands their caches on; chunk_3 (layers 15-24, all
    KV-shared) keeps nothing, so it has no prefill, and takes them, as the head chunk does."""
    plan = ChunkPlan.build(ModelSpec.from_config(e2b_config), split=parse_split("8,15,25"), kv_batches=(8,))
    roles = plan.describe(4)
    assert [(r["name"], r["layers"][0], r["layers"][-1]) for r in roles] == [
        ("chunk_1", 0, 7),
        ("chunk_2", 8, 14),
        ("chunk_3", 15, 24),
        ("chunk_4", 25, 34),
    ]
    kv = ["kv13_k", "kv13_v", "kv14_k", "kv14_v"]
    assert [(r["reads"], r["hands_on"]) for r in roles] == [([], []), ([], kv), (kv, []), (kv, [])]
    assert [r["stateful"] for r in roles] == [True, True, False, False]
    assert [r["states"] for r in roles] == [["kv_cache_full", "kv_cache_sliding"]] * 2 + [[], []]
    assert [r["functions"] for r in roles] == [["infer", "prefill_b8", "prefill_kv_b8"]] * 2 + [["infer"]] * 2
    assert [(r["computes_ple"], r["head"]) for r in roles] == [
        (True, False),
        (False, False),
        (False, False),
        (False, True),
    ]
    chunk_3 = plan.chunks[2].functions["infer"]["inputs"]
    assert "current_pos" not in chunk_3 and chunk_3["kv14_k"].shape == (1, 1, 2048, 512)
    assert list(plan.chunks[2].functions["infer"]["outputs"]) == ["hidden_states_out"]


def test_a_producer_in_an_earlier_chunk_reaches_a_stateful_reader(e2b_config):
    """14,25: chunk_1 owns producer 13 and hands it to chunk_2, whose KV-shared layers 15-24 read it beside its own
    producer 14; the KV-only prefill runs only cache owners, so it takes no cache."""
    plan = ChunkPlan.build(ModelSpec.from_config(e2b_config), split=(14, 25), kv_batches=(8,))
    c1, c2, c3 = plan.chunks
    assert plan.hands_on(c1) == ["kv13_k", "kv13_v"] and plan.reads(c2) == ["kv13_k", "kv13_v"]
    assert plan.hands_on(c2) == ["kv14_k", "kv14_v"] and plan.reads(c3) == ["kv13_k", "kv13_v", "kv14_k", "kv14_v"]
    assert "kv13_k" not in c2.functions["prefill_kv_b8"]["inputs"]
    assert "kv13_k" not in c1.functions["prefill_kv_b8"]["outputs"]


@pytest.mark.parametrize(
    "split, needle",
    [
        ("25,8", "--split 25,8: boundary 8 does not come after 25; boundaries ascend"),
        ("8,8,25", "--split 8,8,25: boundary 8 does not come after 8"),
        ("0,25", "--split 0,25: boundary 0 is outside 1..35"),
        ("8,25,36", "--split 8,25,36: boundary 36 is outside 1..35"),
        ("8,14", "--split 8,14: layer 14 is a KV producer and must precede the stateless last chunk"),
        ("8,10", "--split 8,10: layer 14 is a KV producer and must precede the stateless last chunk"),
        ("8,x", "--split '8,x': expected layer indices"),
    ],
)
def test_bad_splits_name_the_boundary_or_layer(capsys, split, needle):
    rc, out, err = run(capsys, "plan", E2B, "--split", split)
    assert rc == 2 and out == "" and needle in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--split", "5,13,9"], "--split 5,13,9: boundary 9 does not come after 13"),
        (["--split", "5,9"], "--split 5,9: layer 9 is a KV producer and must precede the stateless last chunk"),
        (["--max-chunk-mb", "0.01"], "--max-chunk-mb 0.01: layer 0 with the PLE projection alone needs"),
    ],
)
def test_a_bad_split_or_budget_writes_nothing(capsys, tiny_e2b, tmp_path, flags, needle):
    rc, out, err = run(capsys, "convert", tiny_e2b, tmp_path / "out", *flags)
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


# -- sizes and budgets ------------------------------------------------------------------------------------------


def test_chunk_weights_at_16_bits_are_the_chunk_models_parameters(tiny_e2b):
    """At 16 bits a chunk stores its parameters in fp16: 2 bytes each, as the chunk module holds them."""
    from gemma_ane.convert.models.text import ChunkModel

    spec = ModelSpec.from_pretrained(tiny_e2b)
    plan = ChunkPlan.build(spec, 128, split=(3, 9, 11))
    for c in plan.chunks:
        model = ChunkModel(plan, c)
        params = sum(p.numel() for p in model.parameters()) + model.layers[str(c.layers[0])].layer_scalar.numel() * len(
            c.layers
        )
        assert chunk_weight_bytes(spec, c.layers, c.computes_ple, c.has_head, 16) == 2 * params, c.name


def test_max_chunk_mb_keeps_every_chunk_in_the_budget(e2b_config):
    spec = ModelSpec.from_config(e2b_config)
    split = split_for_budget(spec, 400, 4)
    plan = ChunkPlan.build(spec, split=split)
    sizes = [r["weight_mb"] for r in plan.describe(4)]
    assert max(sizes) <= 400 and len(plan.chunks) >= 3, sizes
    # one chunk fewer cannot fit: the budget picks the fewest chunks
    assert sum(sizes) > 400 * (len(plan.chunks) - 2)
    assert plan.chunks[-1].layers[0] >= spec.first_shared_layer
    # the default split does not fit 400 MB: chunk_2 (17 layers) alone is larger
    default = ChunkPlan.build(spec).describe(4)
    assert max(r["weight_mb"] for r in default) > 400


@pytest.mark.parametrize(
    "mb, bits, needle",
    [
        (20, 4, "--max-chunk-mb 20: layer 0 with the PLE projection alone needs 25.0 MB at 4 bits"),
        (50, 4, "--max-chunk-mb 50: layer 34 with the LM head alone needs 236.6 MB at 4 bits"),
        (200, 16, "--max-chunk-mb 200: layer 34 with the LM head alone needs 945.3 MB at 16 bits"),
        (0, 4, "--max-chunk-mb 0.0: must be a finite number of MB > 0"),
    ],
)
def test_a_budget_no_split_can_meet_names_the_layer(capsys, mb, bits, needle):
    rc, out, err = run(capsys, "plan", E2B, "--max-chunk-mb", mb, "--bits", bits)
    assert rc == 2 and out == "" and needle in err, err
    assert len(err.strip().splitlines()) == 1


def test_the_head_alone_over_budget_is_named(e2b_config):
    spec = ModelSpec.from_config(e2b_config)
    head_alone = chunk_weight_bytes(spec, [34], False, True, 4) / 1e6
    first = chunk_weight_bytes(spec, [0], True, False, 4) / 1e6
    assert head_alone > first  # the LM head (262,144 x 1,536) outweighs the PLE projection
    with pytest.raises(ConfigError, match="layer 34 with the LM head alone needs"):
        split_for_budget(spec, (head_alone + first) / 2, 4)


def test_split_and_budget_together_are_refused(capsys):
    rc, out, err = run(capsys, "plan", E2B, "--split", "8,25", "--max-chunk-mb", "700")
    assert rc == 2 and "--split and --max-chunk-mb: give one" in err, err


def test_e4b_planned_at_700_mb(capsys):
    """The full-size E4B at 4 bits: its default chunk_2 is ~1 GB; under --max-chunk-mb 700 every chunk fits."""
    rc, out, err = run(capsys, "plan", E4B, "--json")
    default = json.loads(out)
    assert rc == 0 and max(c["weight_mb"] for c in default["chunks"]) > 900
    rc, out, err = run(capsys, "plan", E4B, "--max-chunk-mb", "700", "--json")
    assert rc == 0 and err == "", err
    plan = json.loads(out)
    assert plan["bits"] == 4 and len(plan["chunks"]) == len(plan["split"]) + 1 >= 4
    assert all(c["weight_mb"] <= 700 for c in plan["chunks"])
    assert {"layers", "states", "reads", "hands_on", "weight_mb", "functions", "head"} <= set(plan["chunks"][0])
    assert plan["chunks"][-1]["head"] and not plan["chunks"][-1]["states"]


def test_plan_table_shows_sizes_and_hand_ons(capsys):
    rc, out, err = run(capsys, "plan", E2B, "--split", "8,15,25")
    assert rc == 0 and err == ""
    assert "chunk_3: layers 15-24" in out and "stateless" in out and "chunk_4: layers 25-34" in out
    assert "takes -; hands on kv13_k, kv13_v, kv14_k, kv14_v" in out
    assert " MB at 4 bits" in out


# -- the engine wiring the plan: graphs against transformers ----------------------------------------------------

SPLITS = {
    # e2b-mini: 15 layers, cache owners 0-9 (producers 8 sliding, 9 full), 10-14 KV-shared
    "e2b-mini": {3: (5, 13), 4: (5, 9, 13), 6: (3, 6, 9, 11, 13)},
    # e4b-mini: 12 layers, owners 0-6 (producers 5 sliding, 6 full), 7-11 KV-shared
    "e4b-mini": {3: (4, 10), 4: (3, 6, 9), 6: (2, 4, 6, 8, 10)},
}


def _ckpt(request, preset):
    return request.getfixturevalue("tiny_e2b" if preset == "e2b-mini" else "tiny_e4b")


@pytest.mark.parametrize("n", [4, 6])
@pytest.mark.parametrize("preset", ["e2b-mini", "e4b-mini"])
def test_n_chunk_graphs_match_transformers(request, preset, n):
    """Prefill batches, decode steps across several ring passes: every position's logits against transformers."""
    from gemma_ane.oracle.verify import verify_graph

    r = verify_graph(_ckpt(request, preset), tokens=72, prompt_len=11, precision="fp32", split=SPLITS[preset][n])
    assert r["passed"] and r["top1_agreement"] == 1.0 and r["min_cosine"] >= 0.9999, r


def test_the_engine_refuses_a_stateful_chunk_after_a_stateless_one(tiny_e2b):
    from gemma_ane.convert.checkpoint import Checkpoint
    from gemma_ane.convert.models.text import TorchChunk, build_chunks
    from gemma_ane.oracle.verify import host_from_checkpoint
    from gemma_ane.runtime.engine import Engine

    ckpt = Checkpoint(tiny_e2b)
    plan = ChunkPlan.build(ckpt.spec, 128, split=(5, 9, 13))
    chunks = [TorchChunk(m) for m in build_chunks(plan, ckpt)]
    with pytest.raises(ValueError, match="the stateful chunks must come first"):
        Engine.from_chunks([chunks[0], chunks[3], chunks[1], chunks[2]], host_from_checkpoint(ckpt, 128))
    engine = Engine.from_chunks(chunks, host_from_checkpoint(ckpt, 128))
    assert (engine.body, engine.tail) == ([0, 1, 2], [3])
    logits = engine.feed(np.arange(1, 20), logits="last")[-1]
    assert np.isfinite(logits).all() and set(engine.shared_kv) == {"kv8_k", "kv8_v", "kv9_k", "kv9_v"}


# -- converted bundles -------------------------------------------------------------------------------------------

CONTEXT, K = 256, 3
PROMPT = "the cat sat on the mat and"
# Each preset converted at one count besides the default three (each conversion costs a minute of the suite): the
# graph tests above prove every count of SPLITS for both presets; these prove the packages, e2b-mini's with the
# drafter and the vision model at four chunks, e4b-mini's at six.
BUNDLED = {"e2b-mini": 4, "e4b-mini": 6}
# fp16 programs against fp16 programs (cut elsewhere, or a verify batch against decode steps): the logit error
# bound the drafter's tests use (tests/test_drafter.py)
ERR = 0.25


def _bundle(factory, name, ckpt, split, **options):
    from gemma_ane.convert import ConvertOptions, convert

    out = factory.mktemp(name) / "bundle"
    options = {"context": CONTEXT, "bits": 16, "vision": False, "split": split, **options}
    convert(str(ckpt), str(out), ConvertOptions(**options), progress=False)
    return out


@pytest.fixture(scope="module")
def e2b_bundles(pair, tmp_path_factory, request):
    """e2b-mini with its drafter and its vision model at 3 and BUNDLED's chunks (fp16 weights, 70 soft tokens): the
    three-chunk bundle is conftest's (SPLITS' 3 is the default split, K the default draft count). Asked for after
    this file's own: meanwhile the other worker may be converting it for a file of its own."""
    ckpt, asst = pair
    options = {"assistant": str(asst), "draft_tokens": K, "vision": True, "image_tokens": 70}
    n = BUNDLED["e2b-mini"]
    more = {n: _bundle(tmp_path_factory, f"e2b{n}", ckpt, SPLITS["e2b-mini"][n], **options)}
    return ckpt, {3: request.getfixturevalue("e2b_full16"), **more}


@pytest.fixture(scope="module")
def e4b_bundles(tiny_e4b, tmp_path_factory, request):
    """e4b-mini at 3 and BUNDLED's chunks: the three-chunk bundle is conftest's (SPLITS' 3 is the default split), asked
    for last as e2b_bundles' is."""
    n = BUNDLED["e4b-mini"]
    more = {n: _bundle(tmp_path_factory, f"e4b{n}", tiny_e4b, SPLITS["e4b-mini"][n])}
    return tiny_e4b, {3: request.getfixturevalue("e4b_bundle16"), **more}


def _greedy(bundle, prompt, steps):
    """Greedy decoding straight on the engine: the tokens and the logit rows each was chosen from."""
    from gemma_ane.bundle import open_bundle
    from gemma_ane.runtime.backend import open_engine
    from gemma_ane.runtime.device import Device

    engine = open_engine(open_bundle(bundle, check=False), Device.of("mil"))
    _, logits = engine.prompt(prompt)
    tokens, rows = [], []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        rows.append(np.asarray(logits, np.float64))
        logits = engine.feed([tokens[-1]], logits="last")[-1]
    return tokens, rows


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["e2b-mini", "e4b-mini"])
def test_n_chunk_bundles_match_transformers_and_the_three_chunk_bundle(request, preset):
    from margins import assert_greedy_prefix

    from gemma_ane.bundle import read_model_config
    from gemma_ane.oracle.verify import FP16_MIN_COSINE, FP16_MIN_TOP1, verify_bundle

    n = BUNDLED[preset]
    ckpt, bundles = request.getfixturevalue("e2b_bundles" if preset == "e2b-mini" else "e4b_bundles")
    config = read_model_config(bundles[n])
    assert [c["name"] for c in config["chunks"]] == [f"chunk_{i + 1}" for i in range(n)]
    assert "chunks" not in read_model_config(bundles[3])  # the published layout's model_config.json
    for path in ("all", "generate"):
        r = verify_bundle(ckpt, bundles[n], tokens=96, precision="fp16", prompt_len=13, prompt_path=path)
        assert r["top1_agreement"] >= FP16_MIN_TOP1 and r["min_cosine"] >= FP16_MIN_COSINE, (path, r)
    prompt = [2, *range(40, 70)]
    ref, ref_rows = _greedy(bundles[3], prompt, 40)
    ours, _ = _greedy(bundles[n], prompt, 40)
    assert_greedy_prefix(ours, ref, ref_rows, ERR, min_steps=20, where=f"{n} chunks")


@pytest.mark.slow
def test_n_chunk_bundles_with_an_image_and_drafts(e2b_bundles):
    """An image prompt against transformers, and greedy generation with the drafter's verify calls equal to plain
    greedy and to the three-chunk bundle's."""
    from margins import assert_greedy_prefix
    from PIL import Image

    from gemma_ane.oracle.verify import FP16_MIN_COSINE, FP16_MIN_TOP1, verify_bundle
    from gemma_ane.runtime.model import load

    ckpt, bundles = e2b_bundles
    n = BUNDLED["e2b-mini"]
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (48, 80, 3), np.uint8))
    r = verify_bundle(ckpt, bundles[n], tokens=16, prompt_len=6, images=[image])
    assert r["image_tokens"] > 0 and r["top1_agreement"] >= FP16_MIN_TOP1 and r["min_cosine"] >= FP16_MIN_COSINE, r
    runs = {}
    for k in (3, n):
        model = load(bundles[k], backend="mil")
        plain = model.generate(PROMPT, raw=True, max_tokens=24, temperature=0.0, draft_tokens=0, logprobs=2)
        drafted = model.generate(PROMPT, raw=True, max_tokens=24, temperature=0.0, draft_tokens=K)
        assert drafted.tokens_per_verify >= 1 and not model.drafts_unavailable, k  # verify calls ran
        rows = [dict(top) for top in plain.top_logprobs]  # the top two (logprobs: margins as the logits')
        assert_greedy_prefix(drafted.tokens, plain.tokens, rows, ERR, min_steps=8, where=f"{k} chunks, drafted")
        runs[k] = plain.tokens, rows
    assert_greedy_prefix(runs[n][0], *runs[3], ERR, min_steps=8, where=f"{n} chunks vs 3")
