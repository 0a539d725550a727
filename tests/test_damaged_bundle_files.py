"""A bundle's small files damaged: JSON nested past the parser's stack, a JSON file that is no object, a tokenizer
or chat template that cannot be read, generation defaults of the wrong type. Each ends in one line naming the
file (and the field), never a traceback, nor an error blamed on a flag the user never typed.

The loading steps are tested on files alone (fast); the commands on a copy of the shared 16-bit bundle (slow)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from gemma_ane.bundle import BundleError, check_bundle, inspect_bundle
from gemma_ane.cli import main
from gemma_ane.files import FileFormatError, read_json, read_json_object
from gemma_ane.runtime import hf_files

DEEP = "[" * 100000 + "]" * 100000  # the C parser recurses once per level: past Python's recursion limit


def one_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# -- the readers, on files alone ----------------------------------------------------------------------------


def test_json_nested_past_the_stack_is_a_file_format_error_naming_the_file(tmp_path):
    path = tmp_path / "model_config.json"
    path.write_text(DEEP)
    with pytest.raises(FileFormatError, match=rf"^{path}: unreadable JSON \(nested too deeply\)$"):
        read_json(path)


@pytest.mark.parametrize("text, found", [("[]", "list"), ("[1]", "list"), ("3", "int"), ('"x"', "str")])
def test_a_json_file_that_must_be_an_object_says_so(tmp_path, text, found):
    path = tmp_path / "generation_config.json"
    path.write_text(text)
    with pytest.raises(FileFormatError, match=rf"^{path}: expected a JSON object, found {found}$"):
        read_json_object(path)


@pytest.mark.parametrize("text", ["", "garbage", '{"model": 1}', DEEP])
def test_an_unreadable_tokenizer_is_a_bundle_error_naming_it(tmp_path, text):
    path = tmp_path / "tokenizer.json"
    path.write_text(text)
    with pytest.raises(BundleError, match=rf"^{path}: unreadable tokenizer \(") as e:
        hf_files.read_tokenizer(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "config, needle",
    [
        ([1], "expected a JSON object, found list"),
        ({"eos_token_id": "x"}, "eos_token_id='x': expected a token id or a list of token ids"),
        ({"eos_token_id": [1, -2]}, "eos_token_id=[1, -2]: expected a token id"),
        ({"eos_token_id": True}, "eos_token_id=True: expected a token id"),
        ({"temperature": "hot"}, "temperature='hot': expected a number"),
        ({"top_k": 1.5}, "top_k=1.5: expected an integer"),
        ({"top_p": 2.0}, "top_p=2.0: must be <= 1.0"),
    ],
)
def test_generation_defaults_of_the_wrong_kind_name_the_file_and_field(tmp_path, config, needle):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(BundleError) as e:
        hf_files.read_generation_config(path)
    assert str(e.value).startswith(f"{path}: {needle}")


def test_sound_generation_defaults_read_back(tmp_path):
    path = tmp_path / "generation_config.json"
    config = {"do_sample": True, "temperature": 1.0, "top_k": 64, "top_p": 0.95, "eos_token_id": [1, 106]}
    path.write_text(json.dumps(config))
    assert hf_files.read_generation_config(path) == config
    assert hf_files.read_generation_config(tmp_path / "absent.json") == {}


@pytest.mark.parametrize("name, text", [("tokenizer_config.json", "[]"), ("tokenizer_config.json", DEEP)])
def test_a_damaged_tokenizer_config_is_a_bundle_error_naming_it(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(BundleError, match=rf"^{tmp_path / name}: "):
        hf_files.read_template(tmp_path)


def test_a_chat_template_not_in_utf8_is_a_bundle_error_naming_it(tmp_path):
    path = tmp_path / "chat_template.jinja"
    path.write_bytes(b"\xff\xfe{{ messages }}")
    with pytest.raises(BundleError, match=rf"^{path}: unreadable chat template \('utf-8' codec"):
        hf_files.read_template(tmp_path)


@pytest.mark.parametrize("what", ["absent", "file"])
def test_check_of_what_is_no_bundle_directory_is_one_line(tmp_path, capsys, what):
    path = tmp_path / "bundle"
    if what == "file":
        path.write_text("not a bundle")
    with pytest.raises(BundleError, match=rf"^{path}: not a bundle directory$"):
        check_bundle(path)
    assert main(["check", str(path)]) == 2
    assert f"{path}: not a bundle directory" in one_line(capsys)


# -- the commands, on a damaged copy of a bundle ------------------------------------------------------------


@pytest.fixture
def damaged(tiny_bundle16, tmp_path):
    """A copy of the bundle with `rel` replaced by `data`, its manifest entry restamped (else the manifest's size
    check would refuse it first)."""

    def make(rel: str, data: str | bytes) -> Path:
        b = Path(shutil.copytree(tiny_bundle16, tmp_path / "bundle"))
        path = b / rel
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        manifest = json.loads((b / "manifest.json").read_text()) if rel != "manifest.json" else None
        if manifest is not None and rel in manifest["files"]:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            manifest["files"][rel] = {"size": path.stat().st_size, "sha256": digest}
            (b / "manifest.json").write_text(json.dumps(manifest))
        return b

    return make


def generate(b: Path) -> int:
    return main(["generate", str(b), "-p", "Hello", "--raw", "--max-tokens", "2", "--backend", "mil"])


def test_a_model_config_nested_past_the_stack_is_one_line_from_generate_and_check(damaged, capsys):
    b = damaged("model_config.json", DEEP)
    assert generate(b) == 2
    assert f"{b / 'model_config.json'}: unreadable JSON (nested too deeply)" in one_line(capsys)
    assert main(["check", str(b)]) == 1
    assert f"{b / 'model_config.json'}: unreadable JSON (nested too deeply)" in one_line(capsys)


@pytest.mark.parametrize(
    "rel, data, needle",
    [
        ("hf_model/tokenizer.json", "", "unreadable tokenizer"),
        ("hf_model/tokenizer.json", "garbage", "unreadable tokenizer"),
        ("hf_model/tokenizer_config.json", "[]", "expected a JSON object, found list"),
        ("hf_model/generation_config.json", "[1]", "expected a JSON object, found list"),
        ("hf_model/generation_config.json", '{"eos_token_id": "x"}', "eos_token_id='x': expected a token id"),
        ("hf_model/generation_config.json", '{"temperature": "hot"}', "temperature='hot': expected a number"),
        ("hf_model/chat_template.jinja", b"\xff{{ messages }}", "unreadable chat template"),
    ],
)
def test_damaged_files_of_the_tokenizer_are_one_line_from_generate(damaged, capsys, rel, data, needle):
    b = damaged(rel, data)
    assert generate(b) == 2
    err = one_line(capsys)
    assert f"{b / rel}: {needle}" in err and "--temperature" not in err


def test_inspect_of_a_manifest_that_is_no_object_is_one_line(damaged, capsys):
    b = damaged("manifest.json", "[1]")
    with pytest.raises(BundleError, match=r"manifest\.json: expected a JSON object, found list$"):
        inspect_bundle(b)
    assert main(["inspect", str(b)]) == 2
    assert f"{b / 'manifest.json'}: expected a JSON object, found list" in one_line(capsys)
    assert main(["check", str(b)]) == 1
    assert f"{b / 'manifest.json'}: expected a JSON object, found list" in one_line(capsys)
