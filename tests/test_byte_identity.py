"""Converted bundles are byte-identical to those recorded in tests/fixtures/bundle_hashes.json (every file's
sha256; source paths, and what coremltools leaves to chance, put aside: tests/bundle_hashes.py), so a refactor of
the converter or of the bundle format cannot change what is published without a test saying so. Recorded on
70f4640, before the converter became convert/ and the format bundle/."""

import json

import pytest
from bundle_hashes import FIXTURE, file_hashes

RECORDED = json.loads(FIXTURE.read_text())


def differences(found: dict, case: str) -> list[str]:
    want = RECORDED[case]
    return [
        f"{f}: {found.get(f, 'missing')} != {want.get(f, 'absent')}"
        for f in sorted(set(want) | set(found))
        if found.get(f) != want.get(f)
    ]


@pytest.mark.slow
def test_the_published_bundle_is_byte_identical(tiny_published, tiny_e2b):
    """conftest's tiny_published is the e2b-mini-published case, converted in a fresh process (conftest's
    _convert_fresh): hashed where it lies, not converted again."""
    assert differences(file_hashes(tiny_published, {"<CKPT>": tiny_e2b}), "e2b-mini-published") == []


@pytest.mark.slow
def test_the_full_16_bit_bundle_is_byte_identical(e2b_full16, pair):
    """conftest's e2b_full16 is the e2b-mini-16bit case (drafter, vision model), converted in a fresh process:
    hashed where it lies (test_nchunks reads it too), not converted again."""
    ckpt, asst = pair
    assert differences(file_hashes(e2b_full16, {"<CKPT>": ckpt, "<ASSISTANT>": asst}), "e2b-mini-16bit") == []


@pytest.mark.slow
def test_the_full_4_bit_bundle_is_byte_identical(e2b_full4, pair):
    """conftest's e2b_full4 is the e2b-mini-4bit case (drafter, vision model), converted in a fresh process: hashed
    where it lies (test_drafter reads its drafter too), not converted again."""
    ckpt, asst = pair
    assert differences(file_hashes(e2b_full4, {"<CKPT>": ckpt, "<ASSISTANT>": asst}), "e2b-mini-4bit") == []


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
