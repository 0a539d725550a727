"""Bundles damaged after conversion (issue 18, defects 5-8): each damage ends in a one-line error
naming the file or chunk, never in silent garbage, a traceback, or a `check` that passes having
checked nothing.

Every test copies the shared 16-bit bundle (or the published one) and damages the copy.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

import gemma_ane
from gemma_ane.bundle import BundleError, check_bundle, read_model_config
from gemma_ane.cli import main
from gemma_ane.mil.package import PackageError
from gemma_ane.runtime.engine import NonFiniteOutput

WEIGHTS = "Data/com.apple.CoreML/weights/weight.bin"


@pytest.fixture
def copy(tiny_bundle16, tmp_path):
    def make(src: Path = tiny_bundle16) -> Path:
        return Path(shutil.copytree(src, tmp_path / "bundle"))

    return make


@pytest.fixture
def lenient(monkeypatch):
    """The executor as users run it: strict mode (the tests' default) would stop at the first op that
    makes a NaN, before the engine sees the logits."""
    monkeypatch.delenv("GEMMA_ANE_STRICT", raising=False)


def poison(package: Path) -> None:
    """Every fp16 blob of a package's weight file set to NaN: headers intact, sizes unchanged (only a
    sha256 can tell). Blob file v2: a 64-byte header (count), then per blob 64 bytes of metadata
    (sentinel, dtype, size, offset) and its data, 64-byte aligned."""
    path = package / WEIGHTS
    data = bytearray(path.read_bytes())
    pos = 64
    for _ in range(struct.unpack_from("<I", data, 0)[0]):
        _, dtype, size, offset = struct.unpack_from("<IIQQ", data, pos)
        if dtype == 1:  # fp16
            data[offset : offset + size] = b"\x00\x7e" * (size // 2)
        pos = (offset + size + 63) // 64 * 64
    path.write_bytes(bytes(data))


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def one_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# -- 5: non-finite logits ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def poisoned(tiny_bundle16, tmp_path_factory):
    """chunk -> a model over a copy of the bundle whose chunk has NaN weights, loaded once per module
    as users run it (lenient: strict mode would stop at the first op that makes a NaN)."""
    models = {}

    def get(chunk: int):
        if chunk not in models:
            b = Path(shutil.copytree(tiny_bundle16, tmp_path_factory.mktemp(f"nan{chunk}") / "bundle"))
            poison(b / f"chunk_{chunk}.mlpackage")
            with pytest.MonkeyPatch.context() as m:
                m.delenv("GEMMA_ANE_STRICT", raising=False)
                models[chunk] = gemma_ane.load(b, backend="mil")  # verify=False, as the CLI and the server load
        models[chunk].reset()
        return models[chunk]

    return get


@pytest.mark.parametrize("chunk, where", [(3, "damaged weights in chunk_3)"), (2, "chunk_2 or before it")])
def test_nan_weights_are_an_error_naming_the_chunk_in_every_mode(poisoned, chunk, where):
    model = poisoned(chunk)
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=0)):  # greedy once decoded [0, 0, ...]
        with pytest.raises(NonFiniteOutput, match=r"^chunk_3: logits hold NaN or inf") as e:
            model.generate("Hello", raw=True, max_tokens=4, **sampling)
        assert where in str(e.value) and "\n" not in str(e.value)
        assert model.engine.position == 0  # the caches that made them are not reused


def test_nan_logit_of_the_published_head_is_an_error(tiny_published, tmp_path, lenient):
    b = Path(shutil.copytree(tiny_published, tmp_path / "published"))
    poison(b / "chunk_3.mlpackage")
    with pytest.warns(UserWarning, match="RoPE tables rotate"):
        model = gemma_ane.load(b, backend="mil")
    assert model.head == "token_id"
    with pytest.raises(NonFiniteOutput, match="damaged weights in chunk_3"):
        model.generate("Hello", raw=True, max_tokens=4, temperature=0)


def test_nan_logits_are_a_server_error(poisoned):
    from starlette.testclient import TestClient

    from gemma_ane.server.app import build_app

    http = TestClient(build_app(poisoned(3), model_name="bundle"))
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    # the bundle's fault, not the request's: 500 in OpenAI's shape, the details in the server log
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_nan_logits_are_one_cli_line(copy, lenient, capsys):
    b = copy()
    poison(b / "chunk_3.mlpackage")
    assert main(["generate", str(b), "-p", "Hello", "--raw", "--max-tokens", "4", "--backend", "mil"]) == 2
    assert "chunk_3: logits hold NaN or inf" in one_line(capsys)


# -- 6: check verifies or says it cannot ---------------------------------------------------------


def test_a_bundle_of_ours_without_its_manifest_fails_check(copy, capsys):
    b = copy()
    (b / "manifest.json").unlink()
    flip(b / "chunk_2.mlpackage" / WEIGHTS, 4096)
    assert main(["check", str(b)]) == 1
    assert f"{b / 'manifest.json'}: missing" in one_line(capsys)
    with pytest.raises(BundleError, match="manifest.json: missing"):
        gemma_ane.load(b, backend="mil", verify=True)


@pytest.mark.parametrize("listed", ["none", "all but the weights"])
def test_a_manifest_that_does_not_list_every_file_fails_check(copy, capsys, listed):
    b = copy()
    manifest = json.loads((b / "manifest.json").read_text())
    weights = f"chunk_2.mlpackage/{WEIGHTS}"
    manifest["files"] = {} if listed == "none" else {k: v for k, v in manifest["files"].items() if k != weights}
    (b / "manifest.json").write_text(json.dumps(manifest))
    flip(b / weights, 4096)
    (b / "chunk_2.mlpackage" / ".DS_Store").write_bytes(b"Finder's")  # hidden files: nothing reads them
    assert main(["check", str(b)]) == 1
    out, err = capsys.readouterr()
    assert f"{b / weights}: not listed in the manifest" in err.splitlines() and "ok" not in out
    assert listed == "none" or len(err.splitlines()) == 1
    with pytest.raises(BundleError, match="not listed in the manifest"):
        gemma_ane.load(b, backend="mil", verify=True)


def test_the_published_layout_is_not_verifiable(tiny_published, capsys):
    assert main(["check", str(tiny_published)]) == 3
    out, err = capsys.readouterr()
    assert out.strip() == f"{tiny_published}: not verifiable: no manifest (the published layout has none); " + (
        "required files present"
    )
    assert err == ""
    assert check_bundle(tiny_published) == []  # load(verify=True) still opens it


# -- 7: a damaged weight file --------------------------------------------------------------------


def test_a_damaged_weight_header_is_one_line_naming_the_chunk(copy, capsys):
    b = copy()
    flip(b / "chunk_2.mlpackage" / WEIGHTS, 64)  # the first blob's sentinel
    damage = "Invalid sentinel in blob_metadata at byte 64 of weights/weight.bin"
    want = f"{b / 'chunk_2.mlpackage'}: weight file damaged ({damage}); re-convert"
    with pytest.raises(PackageError, match=r"weight file damaged \(Invalid sentinel"):
        gemma_ane.load(b, backend="mil")
    for command in (["generate", str(b), "-p", "Hi", "--backend", "mil"], ["inspect", str(b)]):
        assert main(command) == 2
        assert want in one_line(capsys)
    from gemma_ane.server.app import main as serve

    assert serve([str(b), "--backend", "mil"]) == 2
    assert want in one_line(capsys)


# -- 8: model_config.json ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        ({}, "vocab_size: missing"),
        ([1, 2], "expected a JSON object, found list"),
        ({"vocab_size": "512"}, "vocab_size='512': expected a positive integer"),
        ({"eos_token_id": None}, "eos_token_id=None: expected a token id below vocab_size 512"),
        ({"bos_token_id": 512}, "bos_token_id=512: expected a token id below vocab_size 512"),
        ({"embed_scale": float("inf")}, "embed_scale=inf: expected a positive fp32 number"),
        ({"layer_types": 3}, "layer_types=3: expected a list of strings"),
        ({"head": "argmax"}, 'head=\'argmax\': expected "logits" or "token_id"'),
    ],
)
def test_model_config_is_checked_field_by_field(copy, capsys, config, message):
    b = copy()
    path = b / "model_config.json"
    if isinstance(config, dict) and config:  # one field changed in the real file
        config = {**json.loads(path.read_text()), **config}
    path.write_text(json.dumps(config))
    (b / "manifest.json").unlink()  # as a hand-edited bundle would be: the manifest would refuse it first
    with pytest.raises(BundleError) as e:
        read_model_config(b)
    assert str(e.value) == f"{path}: {message}"
    assert main(["generate", str(b), "-p", "Hi", "--backend", "mil"]) == 2
    assert f"{path}: {message}" in one_line(capsys)
    assert main(["check", str(b)]) == 1
    assert f"{path}: {message}" in one_line(capsys)
    from gemma_ane.server.app import main as serve

    assert serve([str(b), "--backend", "mil"]) == 2
    assert f"{path}: {message}" in one_line(capsys)
