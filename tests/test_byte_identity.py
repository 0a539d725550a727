"""Converted bundles are byte-identical to those recorded in tests/fixtures/bundle_hashes.json (every file's
sha256; source paths, and what coremltools leaves to chance, put aside: tests/bundle_hashes.py), so a refactor of
the converter or of the bundle format cannot change what is published without a test saying so. Recorded on
70f4640, before the converter became convert/ and the format bundle/."""

import json

import pytest
from bundle_hashes import CASES, FIXTURE, file_hashes

from gemma_ane.convert import ConvertOptions, convert

RECORDED = json.loads(FIXTURE.read_text())


def differences(found: dict, case: str) -> list[str]:
    want = RECORDED[case]
    return [
        f"{f}: {found.get(f, 'missing')} != {want.get(f, 'absent')}"
        for f in sorted(set(want) | set(found))
        if found.get(f) != want.get(f)
    ]


def test_the_published_layout_fixture_is_byte_identical(tiny_published, tiny_e2b):
    """conftest's tiny_published is the e2b-mini-published case: its bytes are checked at no extra conversion."""
    assert differences(file_hashes(tiny_published, {"<CKPT>": tiny_e2b}), "e2b-mini-published") == []


@pytest.mark.slow
@pytest.mark.parametrize("case", ["e2b-mini-4bit", "e2b-mini-16bit"])
def test_a_bundle_with_drafter_and_vision_is_byte_identical(case, pair, tmp_path):
    """e2b-mini with its drafter and its vision model: every component the converter has, at 4 and 16 bits."""
    ckpt, asst = pair
    preset, _, options = CASES[case]
    # force=True as recorded (tests/bundle_hashes.py converts so): the manifest states the options
    options = ConvertOptions(assistant=str(asst), force=True, **options)
    convert(str(ckpt), str(tmp_path / "b"), options, progress=False)
    found = file_hashes(tmp_path / "b", {"<CKPT>": ckpt, "<ASSISTANT>": asst})
    assert differences(found, case) == []


def test_the_hashes_see_a_changed_byte(tmp_path):
    """The comparison is of bytes: one changed byte of one file is a difference naming that file."""
    bundle = tmp_path / "b"
    (bundle / "hf_model").mkdir(parents=True)
    (bundle / "model_config.json").write_text('{"model_name": "ckpt"}')
    (bundle / "hf_model" / "config.json").write_text("{}")
    before = file_hashes(bundle, {"<CKPT>": tmp_path / "ckpt"})
    (bundle / "hf_model" / "config.json").write_text("{ }")
    after = file_hashes(bundle, {"<CKPT>": tmp_path / "ckpt"})
    assert [f for f in before if before[f] != after[f]] == ["hf_model/config.json"]
