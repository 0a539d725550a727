"""The Core ML path without a Mac: coremltools' own Python front-end (MLModel, CompiledMLModel,
MLState, compile_model) over `coreml_standin`, a test-only stand-in for its native layer that runs
the programs on our MIL executor. What this proves: our Core ML backend drives coremltools' real
API correctly and gets the executor's results through it. What it cannot prove: Core ML's own
compilation, rounding or speed on a device.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings

import coremltools as ct
import numpy as np
import pytest
from coreml_standin import install
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types
from coremltools.models.model import MLState

import gemma_ane
from gemma_ane.bundle import BundleError
from gemma_ane.bundle.host import full_mask, sliding_mask
from gemma_ane.mil.executor import MILPackage
from gemma_ane.mil.package import Package
from gemma_ane.runtime.backend import CoreMLBackend
from gemma_ane.runtime.device import BackendError, pick_backend

FP16 = types.fp16


@pytest.fixture
def standin():
    with install() as s:
        yield s


# -- the stand-in itself, on a two-function stateful package (fast) ------------------------------


def accumulator(times: float):
    @mb.program(
        input_specs=[mb.StateTensorSpec(shape=(1, 4), dtype=FP16), mb.TensorSpec(shape=(1, 4), dtype=FP16)],
        opset_version=ct.target.iOS18,
    )
    def prog(acc, x):
        total = mb.add(x=mb.read_state(input=acc), y=mb.mul(x=x, y=np.float16(times)))
        mb.coreml_update_state(state=acc, value=total)
        return mb.mul(x=total, y=np.float16(1), name="total")

    return prog


@pytest.fixture(scope="module")
def adder(tmp_path_factory):
    """adder.mlpackage: `infer` (default; acc += x) and `twice` (acc += 2x), sharing the state `acc`."""
    from coremltools.models.utils import MultiFunctionDescriptor, save_multifunction

    root = tmp_path_factory.mktemp("adder")
    desc = MultiFunctionDescriptor()
    for name, times in (("infer", 1), ("twice", 2)):
        model = ct.convert(
            accumulator(times),
            convert_to="mlprogram",
            minimum_deployment_target=ct.target.iOS18,
            compute_precision=ct.precision.FLOAT16,
            skip_model_load=True,
        )
        model.save(str(root / f"{name}.mlpackage"))
        desc.add_function(str(root / f"{name}.mlpackage"), src_function_name="main", target_function_name=name)
    desc.default_function_name = "infer"
    save_multifunction(desc, str(root / "adder.mlpackage"))
    return root / "adder.mlpackage"


X = np.array([[1, 2, 3, 4]], np.float16)


def test_mlmodel_runs_every_function_on_one_state(adder, standin):
    add = ct.models.MLModel(str(adder))  # no function_name: the package's default
    twice = ct.models.MLModel(str(adder), compute_units=ct.ComputeUnit.CPU_AND_NE, function_name="twice")
    assert (add.function_name, twice.function_name) == ("infer", "twice")
    assert (str(adder), "CPU_AND_NE", "twice") in standin.loads
    state = add.make_state()
    assert isinstance(state, MLState)
    out = add.predict({"x": X}, state=state)
    assert list(out) == ["total"] and out["total"].dtype == np.float32  # Core ML widens fp16 outputs
    np.testing.assert_array_equal(out["total"], X)
    np.testing.assert_array_equal(twice.predict({"x": X}, state=state)["total"], 3 * X)
    np.testing.assert_array_equal(add.predict({"x": X}, state=state)["total"], 4 * X)
    np.testing.assert_array_equal(state.read_state("acc"), 4 * X)
    np.testing.assert_array_equal(twice.predict({"x": X}, state=twice.make_state())["total"], 2 * X)  # fresh: zero
    state.write_state("acc", np.full((1, 4), 10, np.float32))
    np.testing.assert_array_equal(add.predict({"x": X}, state=state)["total"], 10 + X)


def test_compile_model_and_compiled_mlmodel_round_trip(adder, standin, tmp_path):
    dest = tmp_path / "adder.mlmodelc"
    assert ct.utils.compile_model(str(adder), str(dest)) == str(dest)
    assert "func infer(x: float16[1, 4], acc: float16[1, 4]) -> (total)" in (dest / "model.mil").read_text()
    add = ct.models.CompiledMLModel(str(dest), ct.ComputeUnit.CPU_ONLY, function_name="infer")
    twice = ct.models.CompiledMLModel(str(dest), ct.ComputeUnit.CPU_ONLY, function_name="twice")
    state = twice.make_state()  # one function's state serves the other
    np.testing.assert_array_equal(twice.predict({"x": X}, state=state)["total"], 2 * X)
    np.testing.assert_array_equal(add.predict({"x": X}, state=state)["total"], 3 * X)
    # the compiled model an MLModel holds, and an asset from a path, load the same way
    held = ct.models.MLModel(str(adder), function_name="twice").get_compiled_model_path()
    again = ct.models.CompiledMLModel(held, function_name="twice")
    np.testing.assert_array_equal(again.predict({"x": X}, state=again.make_state())["total"], 2 * X)
    asset = ct.models.model.MLModelAsset(ct.models.model.MLModelAsset.from_path(str(dest)))
    from_asset = ct.models.CompiledMLModel.from_asset(asset, function_name="infer")
    np.testing.assert_array_equal(from_asset.predict({"x": X}, state=from_asset.make_state())["total"], X)


def test_standin_refuses_what_core_ml_refuses(adder, standin, tmp_path):
    dest = ct.utils.compile_model(str(adder), str(tmp_path / "adder.mlmodelc"))
    with pytest.raises(RuntimeError, match="no function 'nope' in the model"):
        ct.models.CompiledMLModel(dest, function_name="nope")
    with pytest.warns(RuntimeWarning, match="no function 'nope'"), pytest.raises(ValueError, match="nope not found"):
        ct.models.MLModel(str(adder), function_name="nope")  # coremltools' own check, after the native load failed
    (tmp_path / "apple.mlmodelc").mkdir()
    with pytest.raises(RuntimeError, match="not a compiled model this stand-in made"):
        ct.models.CompiledMLModel(str(tmp_path / "apple.mlmodelc"))
    add = ct.models.CompiledMLModel(dest)
    state = add.make_state()
    with pytest.raises(RuntimeError, match="'x' is required"):
        add.predict({}, state=state)
    with pytest.raises(RuntimeError, match="stateful"):
        add.predict({"x": X})
    with pytest.raises(RuntimeError, match=r"'x': expects \(1, 4\) float16, got \(1, 3\)"):
        add.predict({"x": X[:, :3]}, state=state)
    with pytest.raises(RuntimeError, match="value type not convertible"):
        state.write_state("acc", X)  # MLState.write_state hands fp16 to the bridge, which takes no fp16
    with pytest.raises(RuntimeError, match="no state named 'kv'"):
        state.read_state("kv")
    shutil.copytree(adder, tmp_path / "other.mlpackage")  # another package (a compiled copy would be the same one)
    other = ct.models.CompiledMLModel(ct.utils.compile_model(str(tmp_path / "other.mlpackage")))
    with pytest.raises(RuntimeError, match="another model package"):
        add.predict({"x": X}, state=other.make_state())
    standin.refuse.add("twice")  # an ANE compile failure: the Neural Engine refuses, the CPU does not
    with pytest.raises(RuntimeError, match="'twice': ANECCompile"):
        ct.models.CompiledMLModel(dest, ct.ComputeUnit.CPU_AND_NE, function_name="twice")
    ct.models.CompiledMLModel(dest, ct.ComputeUnit.CPU_ONLY, function_name="twice")


def test_coreml_backend_through_coremltools(adder, standin, caplog):
    with caplog.at_level("INFO", logger="gemma_ane"):
        assert pick_backend("auto") == "coreml"
    assert "Core ML" in caplog.text
    chunk = CoreMLBackend(adder, compute_units="cpu_only")
    assert list(chunk.interfaces) == ["infer", "twice"]
    # open loads infer alone, from the package (which compiles it) ...
    assert standin.loads == [(str(adder), "CPU_ONLY", "infer")] and list(chunk.models) == ["infer"]
    state = chunk.make_state()
    np.testing.assert_array_equal(chunk.predict("twice", {"x": X.astype(np.float64)}, state)["total"], 2 * X)
    # ... and another function on first use, from that one compiled model
    assert chunk.compiled.endswith(".mlmodelc") and standin.loads[1:] == [(chunk.compiled, "CPU_ONLY", "twice")]
    assert isinstance(chunk.models["twice"], ct.models.CompiledMLModel)
    np.testing.assert_array_equal(chunk.predict("infer", {"x": X}, state)["total"], 3 * X)
    with pytest.raises(BackendError, match="adder: no function 'prefill_b8' \\(has infer, twice\\)"):
        chunk.predict("prefill_b8", {"x": X}, state)


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS only")
def test_without_the_standin_this_is_linux_again(adder):
    with install():
        pass
    assert "coremltools.libcoremlpython" not in sys.modules
    with pytest.raises(BackendError, match="needs macOS"):
        pick_backend("coreml")
    with pytest.raises(Exception, match="only supported on macOS 15"):
        ct.models.MLModel(str(adder)).make_state()


# -- our chunks through coremltools (slow: a converted bundle) -----------------------------------


def chunk_inputs(bundle, interface: dict, p0: int, rng) -> dict:
    """chunk_1's inputs at position p0, as the engine builds them (random hidden states)."""
    full, sliding = (interface[k]["shape"][-1] for k in ("causal_mask_full", "causal_mask_sliding"))
    T = interface["hidden_states"]["shape"][1]
    tables = {f"{t}_{k[0]}": np.load(bundle / f"{t}_{k}.npy") for t in ("cos", "sin") for k in ("full", "sliding")}
    x = {
        "hidden_states": rng.standard_normal(interface["hidden_states"]["shape"]),
        "per_layer_raw": rng.standard_normal(interface["per_layer_raw"]["shape"]),
        "causal_mask_full": full_mask(p0, T, full, np.float32),
        "causal_mask_sliding": sliding_mask(p0, T, sliding, np.float32),
        "current_pos": np.array([p0], np.int32),
        "ring_pos": np.array([p0 % sliding], np.int32),
        **{k: v[p0 : p0 + T][None, None] for k, v in tables.items()},
    }
    assert set(x) == set(interface), "chunk_1's inputs changed: update chunk_inputs"
    return {k: v.astype(interface[k]["dtype"]) for k, v in x.items()}


# infer, a batch, then infer again: one state through both functions, past the 16-slot ring
SEQUENCE = (("infer", 0), ("prefill_b8", 1), ("infer", 9), ("infer", 17))


def run_sequence(models: dict, state, bundle) -> list[dict]:
    rng, package = np.random.default_rng(0), Package.open(bundle / "chunk_1.mlpackage")
    outs = []
    for function, p0 in SEQUENCE:
        x = chunk_inputs(bundle, package.interface(function)["inputs"], p0, rng)
        outs.append(models[function].predict(x, state=state))
    return outs


def assert_same_as_executor(bundle, models: dict, make_state, read_state):
    mil = MILPackage(bundle / "chunk_1.mlpackage")
    want_state, state = mil.make_state(), make_state()
    want = run_sequence(mil.functions, want_state, bundle)
    got = run_sequence(models, state, bundle)
    for (function, p0), w, g in zip(SEQUENCE, want, got):
        assert set(g) == set(w), function
        for name in w:
            assert g[name].dtype == np.float32, name
            np.testing.assert_array_equal(g[name], w[name].astype(np.float32), err_msg=f"{function}@{p0} {name}")
    for name, a in want_state.arrays.items():
        np.testing.assert_array_equal(read_state(state, name), a.astype(np.float32), err_msg=name)
    assert any(np.any(a) for a in want_state.arrays.values())  # the caches were written


def test_mlmodel_over_a_chunk_equals_the_executor(tiny_bundle16, standin):
    path = str(tiny_bundle16 / "chunk_1.mlpackage")
    units = ct.ComputeUnit.CPU_AND_NE
    models = {f: ct.models.MLModel(path, compute_units=units, function_name=f) for f in ("infer", "prefill_b8")}
    assert_same_as_executor(tiny_bundle16, models, models["infer"].make_state, MLState.read_state)


def test_compiled_chunk_equals_the_executor(tiny_bundle16, standin, tmp_path):
    dest = ct.utils.compile_model(str(tiny_bundle16 / "chunk_1.mlpackage"), str(tmp_path / "chunk_1.mlmodelc"))
    assert "func prefill_b8(" in (tmp_path / "chunk_1.mlmodelc" / "model.mil").read_text()
    units = ct.ComputeUnit.CPU_AND_NE
    models = {f: ct.models.CompiledMLModel(dest, units, function_name=f) for f in ("infer", "prefill_b8")}
    assert_same_as_executor(tiny_bundle16, models, models["prefill_b8"].make_state, MLState.read_state)
    with pytest.raises(RuntimeError, match="no function 'prefill_b9'"):
        ct.models.CompiledMLModel(dest, units, function_name="prefill_b9")


def test_generate_through_coreml_equals_the_mil_backend(tiny_bundle16, standin):
    kw = dict(raw=True, temperature=0, max_tokens=24)
    prompt = "The quick brown fox jumps over the lazy dog, and then it runs far away"
    mil = gemma_ane.load(tiny_bundle16, backend="mil").generate(prompt, **kw)
    model = gemma_ane.load(tiny_bundle16, backend="coreml")
    assert model.backend == "coreml" and all(isinstance(c, CoreMLBackend) for c in model.engine.chunks)
    coreml = model.generate(prompt, **kw)
    assert coreml.tokens == mil.tokens and len(mil.tokens) == 24
    assert model.engine.position > 16  # past the sliding window: the ring wrapped
    assert {f for _, f, _ in model.engine.history} >= {"infer", "prefill_kv_b8"}
    assert {f for _, _, f in standin.loads} == {"infer", "prefill_kv_b8"}  # loaded when used: prefill_b8 never was


def test_reuse_past_the_wrap_and_a_prompt_cache_through_mlstate(tiny_bundle16, standin, tmp_path):
    """Ring snapshots and prompt cache files go through MLState.read_state / write_state (float32
    across the bridge): the same reuse and the same tokens as the MIL backend."""
    turn1 = [{"role": "user", "content": "Tell me a story about a fox"}]
    kw = dict(temperature=0, max_tokens=12)

    def chat(model):
        r1 = model.generate(messages=turn1, **kw)
        turn2 = turn1 + [{"role": "assistant", "content": "Well. " + r1.text}, {"role": "user", "content": "more"}]
        r2 = model.generate(messages=turn2, **kw)
        model.save_prompt_cache(tmp_path / f"{model.backend}.npz", r1.prompt_tokens)
        return r1, r2

    mil, coreml = gemma_ane.load(tiny_bundle16, backend="mil"), gemma_ane.load(tiny_bundle16, backend="coreml")
    (m1, m2), (c1, c2) = chat(mil), chat(coreml)
    assert c2.reused_tokens == m2.reused_tokens == m1.prompt_tokens > coreml.engine.window
    assert (c1.tokens, c2.tokens) == (m1.tokens, m2.tokens)
    with np.load(tmp_path / "mil.npz") as a, np.load(tmp_path / "coreml.npz") as b:
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    fresh = gemma_ane.load(tiny_bundle16, backend="coreml")
    assert fresh.load_prompt_cache(tmp_path / "mil.npz") == m1.prompt_tokens
    assert fresh.generate(messages=turn1, **kw).tokens == m1.tokens


def test_a_function_the_neural_engine_refuses_falls_back_to_infer(tiny_bundle16):
    """CoreML-LLM reports every T>1 stateful function failing ANE compilation on A19 Pro: the prompt
    then runs through infer, with one warning per refused function, and the tokens are those of the
    executor driven the same way."""
    kw = dict(raw=True, temperature=0, max_tokens=8)
    prompt = "The quick brown fox jumps over the lazy dog, and then it runs far away"
    mil = gemma_ane.load(tiny_bundle16, backend="mil")
    mil.engine.prefill_batch, mil.engine.kv_batches = None, ()
    want = mil.generate(prompt, **kw).tokens
    with install(refuse={"prefill_b8", "prefill_kv_b8"}) as standin:
        model = gemma_ane.load(tiny_bundle16, backend="coreml")
        assert {f for _, _, f in standin.loads} == {"infer"}  # nothing else is loaded before it is used
        with pytest.warns(RuntimeWarning) as caught:
            got = model.generate(prompt, **kw).tokens
        messages = sorted(str(w.message) for w in caught)
        assert len(messages) == 2 and all("ANECCompile" in m for m in messages)
        assert messages[0].startswith("chunk_1: function 'prefill_b8' cannot be loaded on cpu_and_ne")
        assert messages[1].startswith("chunk_1: function 'prefill_kv_b8' cannot be loaded on cpu_and_ne")
        assert got == want and {f for _, f, _ in model.engine.history} == {"infer"}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per model, not once per prompt
            model.generate(prompt + " again", **kw)
        standin.refuse.add("infer")
        with pytest.raises(BackendError, match=r"chunk_1.mlpackage: function 'infer' cannot be loaded on cpu_and_ne"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # our one-line error only: coremltools' own warning is not repeated
                gemma_ane.load(tiny_bundle16, backend="coreml")


def test_chat_and_serve_through_coreml_as_a_mac_user_runs_them(tiny_bundle16, standin, monkeypatch, capsys):
    """The README's Mac path beyond generate: `gemma-ane chat` and the OpenAI server, on the Core ML
    backend (coremltools over the stand-in), answer as the MIL backend does."""
    import io

    from starlette.testclient import TestClient

    from gemma_ane.cli import main
    from gemma_ane.server.app import build_app

    script = "Hello there\nAnd again\n"
    answers = []
    for backend in ("mil", "coreml"):
        monkeypatch.setattr(sys, "stdin", io.StringIO(script))
        argv = ["chat", str(tiny_bundle16), "--backend", backend, "--max-tokens", "6", "--temperature", "0"]
        assert main([*argv, "--repetition-penalty", "2"]) == 0  # the penalty keeps the tiny model off newlines
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and len("".join(answers[0].split())) >= 4

    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8, "temperature": 0}
    body["repetition_penalty"] = 2.0
    replies = []
    for backend in ("mil", "coreml"):
        with TestClient(build_app(gemma_ane.load(tiny_bundle16, backend=backend), model_name="b")) as http:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            replies.append(r.json()["choices"][0]["message"]["content"])
    assert replies[0] == replies[1] and replies[0].strip()


# -- compiled bundles: interfaces from what the bundle states ----------------------------------------


@pytest.fixture(scope="module")
def compiled_bundle(tiny_e2b, tmp_path_factory):
    """`convert` as on a Mac: the default compiles every chunk (through the stand-in's compileModel)."""
    from gemma_ane.convert import ConvertOptions, convert

    out = tmp_path_factory.mktemp("compiled") / "bundle"
    with install():
        convert(str(tiny_e2b), str(out), ConvertOptions(context=128, bits=16, vision=False), progress=False)
    return out


@pytest.mark.slow
def test_a_compiled_bundle_generates_as_the_package_bundle(compiled_bundle, tiny_bundle16, standin, capsys):
    from gemma_ane.bundle import check_bundle

    assert sorted(p.name for p in compiled_bundle.glob("chunk_*")) == [f"chunk_{i}.mlmodelc" for i in (1, 2, 3)]
    assert check_bundle(compiled_bundle) == []
    kw = dict(raw=True, temperature=0, max_tokens=24)
    prompt = "The quick brown fox jumps over the lazy dog, and then it runs far away"
    want = gemma_ane.load(tiny_bundle16, backend="mil").generate(prompt, **kw).tokens
    model = gemma_ane.load(compiled_bundle)  # auto: Core ML, as on a Mac
    assert model.backend == "coreml"
    assert model.generate(prompt, **kw).tokens == want
    assert list(model.engine.chunks[0].interfaces) == ["infer", "prefill_b8", "prefill_kv_b8"]


@pytest.mark.slow
def test_a_compiled_published_bundle_runs_on_its_configs(tiny_published, standin, tmp_path):
    """The published layout ships .mlmodelc chunks and no manifest: the interfaces come from the
    plan its hf_model/config.json and model_config.json imply."""
    import shutil

    bundle = tmp_path / "published"
    shutil.copytree(tiny_published, bundle)
    for package in sorted(bundle.glob("chunk_*.mlpackage")):
        ct.utils.compile_model(str(package), str(package.with_suffix(".mlmodelc")))
        shutil.rmtree(package)
    kw = dict(raw=True, temperature=0, max_tokens=12)
    want = gemma_ane.load(tiny_published, backend="mil").generate("Once upon a time", **kw).tokens
    model = gemma_ane.load(bundle, backend="coreml")
    assert model.head == "token_id" and model.generate("Once upon a time", **kw).tokens == want


@pytest.mark.slow
def test_a_compiled_chunk_the_bundle_states_nothing_about_is_one_line(compiled_bundle, standin, tmp_path):
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(compiled_bundle, bundle)
    (bundle / "chunk_2.mlmodelc" / "metadata.json").unlink()  # a compiled chunk whose compiler stated nothing
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["files"]["chunk_2.mlmodelc/metadata.json"]
    manifest["plan"]["chunks"] = [c for c in manifest["plan"]["chunks"] if c["name"] != "chunk_2"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError) as e:
        gemma_ane.load(bundle, backend="coreml")
    assert "chunk_2.mlmodelc: manifest.json plan states no interface" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_inspect_and_check_read_a_compiled_bundle(compiled_bundle, capsys):
    from gemma_ane.cli import main

    assert main(["check", str(compiled_bundle)]) == 0
    assert main(["inspect", str(compiled_bundle)]) == 0
    out = capsys.readouterr().out
    assert "chunk_1 (chunk_1.mlmodelc): layers 0-" in out and "prefill_b8: T=8, costs unknown (compiled)" in out
    assert "manifest: verified" in out
    assert main(["inspect", str(compiled_bundle), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    infer = report["chunks"][0]["functions"]["infer"]
    assert infer["macs_per_token"] is None and infer["inputs"]["hidden_states"]["shape"] == [1, 1, 64]
    assert report["chunks"][1]["states"]["kv_cache_sliding"]["shape"][2] == 16  # the ring, as stated
    assert report["prompt_paths"] == {}
