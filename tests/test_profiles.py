"""Device profiles (`--functions`, `--profile`): which functions every chunk carries, what they would wire on a
device next to the per-program size limits (`plan`, `inspect`), the one-line refusals, the runtime degrading a
prompt path whose function is absent, and a phone bundle generating the full bundle's greedy tokens."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from gemma_ane.bundle.plan import ChunkPlan, device_cost, parse_functions
from gemma_ane.bundle.spec import ModelSpec
from gemma_ane.cli import main
from gemma_ane.convert.options import ConvertError, ConvertOptions

FIXTURES = Path(__file__).parent / "fixtures"
E2B, E4B = FIXTURES / "e2b_config.json", FIXTURES / "e4b_config.json"


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def e2b():
    return ModelSpec.from_pretrained(E2B)


# -- which functions a plan carries ------------------------------------------------------------------------------


def test_the_phone_profile_carries_infer_alone(e2b):
    plan = ChunkPlan.build(e2b, kv_batches=(64, 8), draft_tokens=3, functions=parse_functions(None, "phone"))
    assert [list(c.functions) for c in plan.chunks] == [["infer"]] * 3
    # no KV-only batch is carried, so none pads the ring: the drafter's 32 slots alone
    assert plan.kv_batches == () and plan.ring == 512 + 32
    assert plan.chunks[-1].functions["infer"]["outputs"].keys() == {"logits", "final_hidden"}


def test_kinds_and_names_select_functions(e2b):
    kv = ChunkPlan.build(e2b, kv_batches=(64, 8), functions=("infer", "prefill_kv"))
    assert list(kv.chunks[0].functions) == ["infer", "prefill_kv_b64", "prefill_kv_b8"]
    one = ChunkPlan.build(e2b, kv_batches=(64, 8), draft_tokens=3, functions=("infer", "prefill_b8", "verify_b4"))
    assert [list(c.functions) for c in one.chunks] == [["infer", "prefill_b8", "verify_b4"]] * 2 + [
        ["infer", "verify_b4"]
    ]
    assert one.ring == 512 + 32  # the dropped KV-only batches (64) no longer widen the pad


def test_the_mac_profile_and_no_choice_are_todays_plan(e2b):
    today = ChunkPlan.build(e2b, kv_batches=(64, 8), draft_tokens=3).to_json()
    mac = parse_functions(None, "mac")
    assert ChunkPlan.build(e2b, kv_batches=(64, 8), draft_tokens=3, functions=mac).to_json() == today
    explicit = ("infer", "prefill", "prefill_kv", "verify")
    assert ChunkPlan.build(e2b, kv_batches=(64, 8), draft_tokens=3, functions=explicit).to_json() == today


def test_convert_options_record_a_choice_only_when_made():
    assert "functions" not in ConvertOptions().record() and "profile" not in ConvertOptions().record()
    assert ConvertOptions(profile="phone").record()["profile"] == "phone"
    assert ConvertOptions(profile="phone").carried == ("infer",)
    assert ConvertOptions(functions=("infer", "prefill_kv")).carried == ("infer", "prefill_kv")


# -- bad input: one line, exit 2, nothing written ----------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--functions", "infer,prefill_b9x"], "unknown function 'prefill_b9x'"),
        (["--functions", "prefill_b8"], "every chunk needs infer"),
        (["--functions", "infer,prefill_b16"], "this plan makes no prefill_b16"),
        (["--profile", "tablet"], "--profile 'tablet': choose phone or mac"),
        (["--profile", "phone", "--functions", "infer"], "--functions and --profile: give one"),
    ],
)
def test_plan_refuses_bad_function_choices_in_one_line(capsys, flags, needle):
    rc, out, err = run(capsys, "plan", E2B, *flags)
    assert rc == 2 and out == "" and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--functions", "infer,bogus"], "unknown function 'bogus'"),
        (["--functions", "verify"], "every chunk needs infer"),
        (["--profile", "watch"], "--profile 'watch': choose phone or mac"),
        (["--layout", "published", "--functions", "infer"], "the published layout's functions are fixed"),
        (["--layout", "published", "--profile", "phone"], "the published layout's functions are fixed"),
    ],
)
def test_convert_refuses_bad_function_choices_before_writing(capsys, tmp_path, flags, needle):
    out = tmp_path / "bundle"
    rc, _, err = run(capsys, "convert", FIXTURES, out, "--quiet", *flags)
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_convert_options_refuse_what_the_cli_refuses():
    for options, needle in [
        (ConvertOptions(functions=("prefill",)), "every chunk needs infer"),
        (ConvertOptions(profile="ipad"), "choose phone or mac"),
        (ConvertOptions(layout="published", profile="mac"), "the published layout's functions are fixed"),
    ]:
        with pytest.raises(ConvertError, match=needle):
            options.check()


# -- what the functions would wire -------------------------------------------------------------------------------


def test_wired_cost_follows_the_measurement_and_warns_over_the_limits():
    one, two, big, huge = device_cost(
        [
            ("a", 690e6, {"infer": 690e6}),
            ("b", 690e6, {"infer": 690e6, "prefill_b8": 690e6}),
            ("c", 1050e6, {"infer": 1050e6}),
            ("d", 1200e6, {"infer": 1200e6}),
        ]
    )
    # the figures: a 0.69 GB chunk wires +1.05 GB with one function loaded, +2.09 GB with two
    assert one["wired_mb"] == pytest.approx(1045, abs=10) and two["wired_mb"] == pytest.approx(2090, abs=1)
    assert one["warning"] is two["warning"] is None
    assert (
        big["warning"] == "c: 1050.0 MB of weights exceeds the per-program limit of the iPhone ANE compiler (~1000 MB)"
    )
    assert huge["warning"] == (
        "d: 1200.0 MB of weights exceeds the per-program limit of the iPhone ANE compiler (~1000 MB) and the Mac ANE "
        "service (~1100 MB)"
    )


def test_plan_reports_the_wired_cost_and_a_warning_per_chunk_over_a_limit(capsys):
    rc, out, _ = run(capsys, "plan", E4B, "--bits", "8", "--kv-prefill-batches", "64,8", "--json")
    cost = {c["name"]: c for c in json.loads(out)["device_cost"]}
    assert rc == 0 and cost["chunk_1"]["functions"] == ["infer", "prefill_b8", "prefill_kv_b64", "prefill_kv_b8"]
    assert cost["chunk_3"]["functions"] == ["infer"]
    assert cost["chunk_2"]["weight_mb"] > 1100 and "Mac ANE" in cost["chunk_2"]["warning"]
    assert cost["chunk_1"]["wired_mb"] == pytest.approx(4 * cost["chunk_1"]["weight_mb"] * 2.09 / 2 / 0.69, rel=1e-3)
    rc, out, _ = run(capsys, "plan", E4B, "--bits", "6", "--profile", "phone")
    warned = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert rc == 0 and [w.split(":")[1].strip() for w in warned] == ["chunk_2", "chunk_3"], warned
    assert "chunk_1: " in out and "1 function (infer) wire ~" in out
    rc, out, _ = run(capsys, "plan", E4B)  # 4 bits: every chunk of the default split under both limits
    assert rc == 0 and "device cost" in out and "warning:" not in out


# -- the runtime: a function some chunks lack --------------------------------------------------------------------


def test_a_prompt_function_one_chunk_lacks_degrades_with_one_warning(tiny_bundle16, monkeypatch):
    """chunk_2 without prefill_kv_b8 (as a bundle converted elsewhere may be): the prompt runs through the next path
    (prefill_b8, then infer), as through a bundle without prefill_kv_b8 at all, instead of failing in chunk_2
    mid-prompt."""
    from gemma_ane.bundle import open_bundle
    from gemma_ane.runtime import backend
    from gemma_ane.runtime.device import Device

    real = backend.open_chunks

    def without(function, which):
        def open_chunks(*a, **kw):
            chunks = real(*a, **kw)
            for c in chunks:
                if c.name in which:
                    c.interfaces = {f: io for f, io in c.interfaces.items() if f != function}
            return chunks

        return open_chunks

    ids = list(range(3, 40))
    monkeypatch.setattr(backend, "open_chunks", without("prefill_kv_b8", {"chunk_1", "chunk_2"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, expected = backend.open_engine(open_bundle(tiny_bundle16, check=False), Device.of("mil")).prompt(ids)
    monkeypatch.setattr(backend, "open_chunks", without("prefill_kv_b8", {"chunk_2"}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = backend.open_engine(open_bundle(tiny_bundle16, check=False), Device.of("mil"))
        _, logits = engine.prompt(ids)
    # a ResourceWarning is another test's object (an unclosed socket) finalised by a collection that ran here
    lines = [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)]
    assert lines == ["chunk_2: no function 'prefill_kv_b8'; prompts run without it"], lines
    assert engine.kv_batches == () and engine.prefill_batch == 8 and np.array_equal(logits, expected)


# -- a phone bundle ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def phone_bundle(pair, tmp_path_factory):
    """`convert --profile phone --assistant` of tiny_bundle16's checkpoint at its options (16 bits, context 128)."""
    out = tmp_path_factory.mktemp("phone") / "bundle"
    argv = ["convert", pair[0], out, "--assistant", pair[1], "--bits", "16", "--context", "128", "--no-vision"]
    assert main([str(a) for a in [*argv, "--no-audio", "--quiet", "--profile", "phone"]]) == 0
    return out


@pytest.mark.slow
def test_a_phone_bundle_carries_infer_alone_and_says_what_it_wires(phone_bundle, capsys):
    from gemma_ane.bundle import inspect_bundle
    from gemma_ane.files import read_json

    report = inspect_bundle(phone_bundle)
    assert [list(c["functions"]) for c in report["chunks"]] == [["infer"]] * 3
    assert [c["functions"] for c in report["device_cost"]] == [["infer"]] * 3
    manifest = read_json(phone_bundle / "manifest.json")
    assert manifest["options"]["profile"] == "phone"
    assert [list(c["functions"]) for c in manifest["plan"]["chunks"]] == [["infer"]] * 3
    rc, out, _ = run(capsys, "inspect", phone_bundle)
    assert rc == 0 and "chunk_1: " in out and "1 function (infer) wire ~" in out


@pytest.mark.slow
def test_a_phone_bundle_generates_the_full_bundles_greedy_tokens(phone_bundle, tiny_bundle16):
    """The same weights, prompts run one token at a time: greedy tokens equal to the full bundle's (prefill_b8 and
    KV-only batches) within the fp16 bounds (tests/margins.py), and one warning that prompts are slow."""
    from margins import assert_greedy_prefix

    from gemma_ane.bundle import open_bundle
    from gemma_ane.runtime.backend import open_engine
    from gemma_ane.runtime.device import Device

    def greedy(bundle):
        engine = open_engine(open_bundle(bundle, check=False), Device.of("mil"))
        _, logits = engine.prompt([2, *range(40, 70)])
        tokens, rows = [], []
        for _ in range(40):
            tokens.append(int(np.argmax(logits)))
            rows.append(np.asarray(logits, np.float64))
            logits = engine.feed([tokens[-1]], logits="last")[-1]
        return engine, tokens, rows

    _, ref, ref_rows = greedy(tiny_bundle16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, ours, _ = greedy(phone_bundle)
    assert [str(w.message) for w in caught] == [
        "chunk_1: no batched prompt function (prefill_b*, prefill_kv_b*); prompts run through infer one token at a time"
    ]
    assert engine.prefill_batch is None and engine.kv_batches == () and engine.verify_batch is None
    assert_greedy_prefix(ours, ref, ref_rows, 0.25, min_steps=20, where="phone vs full")


@pytest.mark.slow
def test_a_phone_bundle_refuses_drafts_in_one_line(phone_bundle, capsys):
    """Its drafter is converted, but no chunk carries verify_b4: --draft is refused, naming why."""
    rc, out, err = run(capsys, "generate", phone_bundle, "-p", "hi", "--backend", "mil", "--draft", "3")
    assert rc == 2 and out == ""
    lines = [line for line in err.splitlines() if not line.startswith("warning") and "prompts run" not in line]
    assert lines == [
        "gemma-ane generate: error: --draft 3: this bundle's chunks carry no verify function to check drafts"
    ], err
