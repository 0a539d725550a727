"""The seed's own bundle (issue 44): CoreML-LLM's compiled argmax-era chunk_1 and chunk_2, a chunk_3 converted again
to return logits, CoreML-LLM's model_config.json (no `head`), no manifest. Assembled the same way from a tiny
checkpoint: the published layout's chunk_1/2, our logits chunk_3, the published config without `head`; compiled
through the Core ML stand-in, whose compiler writes metadata.json as Apple's does. The compiled chunks' interfaces
come from that metadata, so the head is what the last chunk returns."""

import json
import shutil

import coremltools as ct
import pytest
from coreml_standin import install

import gemma_ane
from gemma_ane.bundle import BundleError, check_bundle, inspect_bundle
from gemma_ane.bundle.interfaces import metadata_interfaces, read_interfaces
from gemma_ane.cli import main

pytestmark = pytest.mark.slow  # every test here reads converted bundles


def _assemble(published, ours, out):
    shutil.copytree(published, out)
    shutil.rmtree(out / "chunk_3.mlpackage")
    shutil.copytree(ours / "chunk_3.mlpackage", out / "chunk_3.mlpackage")
    config = json.loads((out / "model_config.json").read_text())
    del config["head"]  # CoreML-LLM's config keys
    (out / "model_config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def mixed_packages(tiny_published, tiny_bundle16, tmp_path_factory):
    """The seed's bundle before compilation: the MIL executor runs it."""
    return _assemble(tiny_published, tiny_bundle16, tmp_path_factory.mktemp("seed") / "packages")


@pytest.fixture(scope="module")
def seed_bundle(mixed_packages, tmp_path_factory):
    out = tmp_path_factory.mktemp("seed") / "bundle"
    shutil.copytree(mixed_packages, out)
    with install():
        for package in sorted(out.glob("chunk_*.mlpackage")):
            ct.utils.compile_model(str(package), str(package.with_suffix(".mlmodelc")))
            shutil.rmtree(package)
    return out


@pytest.fixture
def standin():
    with install() as s:
        yield s


def test_metadata_states_every_function_as_the_package_does(seed_bundle, mixed_packages):
    for i in (1, 2, 3):
        compiled = metadata_interfaces(seed_bundle / f"chunk_{i}.mlmodelc")
        assert compiled == read_interfaces(mixed_packages / f"chunk_{i}.mlpackage"), i
    assert list(compiled) == ["infer"] and "logits" in compiled["infer"]["outputs"]
    assert "prefill_b8" in metadata_interfaces(seed_bundle / "chunk_1.mlmodelc")


def test_the_mixed_bundle_matches_transformers_on_the_mil_executor(tiny_e2b, mixed_packages):
    from gemma_ane.oracle.verify import verify_bundle

    report = verify_bundle(tiny_e2b, mixed_packages, tokens=24)
    assert report["passed"], report
    # a bundle without a manifest whose config has no head: CoreML-LLM's files, not a bundle of ours that lost it
    assert check_bundle(mixed_packages) == []
    model = gemma_ane.load(mixed_packages, backend="mil")
    assert model.generate("Once upon a time", raw=True, temperature=0.9, seed=3, max_tokens=4).finish_reason


def test_the_seed_bundle_samples_through_core_ml(seed_bundle, mixed_packages, standin):
    model = gemma_ane.load(seed_bundle, backend="coreml")
    ref = gemma_ane.load(mixed_packages, backend="mil")
    assert model.head == "logits"
    kw = dict(raw=True, max_tokens=10)
    # the stand-in runs the same programs on the same fp16 executor: equal to the token
    assert (
        model.generate("Once upon a time", temperature=0, **kw).tokens
        == ref.generate("Once upon a time", temperature=0, **kw).tokens
    )
    sampled = model.generate("Once upon a time", temperature=0.9, seed=7, logprobs=2, **kw)
    assert sampled.tokens == ref.generate("Once upon a time", temperature=0.9, seed=7, **kw).tokens
    first = model.generate("Once upon a time", temperature=0, raw=True, max_tokens=1).tokens[0]
    banned = model.generate("Once upon a time", temperature=0, raw=True, max_tokens=1, logit_bias={first: -100})
    assert banned.tokens[0] != first


def test_check_and_inspect_describe_it_off_the_mac(seed_bundle, capsys):
    assert check_bundle(seed_bundle) == []
    assert main(["check", str(seed_bundle)]) == 3
    assert "not verifiable: no manifest (a bundle of CoreML-LLM's model config has none)" in capsys.readouterr().out
    report = inspect_bundle(seed_bundle)
    head = report["chunks"][-1]["functions"]["infer"]["outputs"]
    assert list(head) == ["logits"] and head["logits"]["dtype"] == "float16"
    assert list(report["chunks"][0]["functions"]) == ["infer", "prefill_b8"]


def _damaged(seed_bundle, tmp_path, config=None, metadata=None):
    bundle = tmp_path / "bundle"
    shutil.copytree(seed_bundle, bundle)
    if config:
        path = bundle / "model_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if metadata:
        name, edit = metadata
        path = bundle / name / "metadata.json"
        entries = json.loads(path.read_text())
        edit(entries[0])
        path.write_text(json.dumps(entries))
    return bundle


def test_metadata_that_contradicts_the_config_names_file_and_field(seed_bundle, tmp_path, standin):
    bundle = _damaged(seed_bundle, tmp_path, config={"head": "token_id"})
    with pytest.raises(BundleError) as e:
        gemma_ane.load(bundle, backend="coreml")
    want = f"{bundle}/chunk_3.mlmodelc/metadata.json: outputSchema of infer returns logits (head logits), but "
    assert str(e.value) == want + f"{bundle}/model_config.json head is 'token_id'"
    assert check_bundle(bundle) == [str(e.value)]
    context = json.loads((seed_bundle / "model_config.json").read_text())["context_length"]
    bundle = _damaged(seed_bundle, tmp_path / "c", config={"context_length": context * 2})
    problems = check_bundle(bundle)  # every chunk's masks say so
    for i, line in enumerate(problems, 1):
        assert f"chunk_{i}.mlmodelc/metadata.json: inputSchema of infer: causal_mask_full [1, 1, 1, {context}]" in line
        assert line.endswith(f"model_config.json context_length is {context * 2}")
    assert len(problems) == 3


def test_damaged_metadata_is_one_line_naming_the_field(seed_bundle, tmp_path, standin):
    def shape_as_list(entry):
        entry["functions"][0]["inputSchema"][0]["shape"] = [1, 1, 64]

    bundle = _damaged(seed_bundle, tmp_path, metadata=("chunk_2.mlmodelc", shape_as_list))
    with pytest.raises(BundleError) as e:
        gemma_ane.load(bundle, backend="coreml")
    assert "chunk_2.mlmodelc/metadata.json: infer: inputSchema[0].shape: [1, 1, 64]" in str(e.value)
    assert "\n" not in str(e.value)

    def unknown_default(entry):
        entry["defaultFunctionName"] = "main"

    bundle = _damaged(seed_bundle, tmp_path / "d", metadata=("chunk_1.mlmodelc", unknown_default))
    assert check_bundle(bundle) == [
        f"{bundle}/chunk_1.mlmodelc/metadata.json: defaultFunctionName 'main': no such function (has infer, prefill_b8)"
    ]
