import json
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

# Fixtures that convert a bundle (each conversion costs 30-60 s): every test that uses one, directly
# or through another fixture, is slow; so are tests marked by hand (a conversion of their own, or a
# long oracle run). `pytest -m "not slow"` is the fast loop; CI runs everything.
CONVERTING = {"tiny_bundle16", "tiny_bundle4", "bundle", "bundle16", "bundle4", "gqa16"}


def pytest_collection_modifyitems(items):
    for item in items:
        if CONVERTING & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def e2b_config() -> dict:
    """The real gemma-4-E2B-it config.json (CONTRACT §1)."""
    return json.loads((FIXTURES / "e2b_config.json").read_text())


def _tiny(factory, name, **kw):
    from gemma_ane.tiny import write_tiny

    return write_tiny(factory.mktemp(name) / "ckpt", **kw)


@pytest.fixture(scope="session")
def tiny_e2b(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "e2b", preset="e2b-mini")


@pytest.fixture(scope="session")
def tiny_gqa(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "gqa", preset="gqa-mini")


@pytest.fixture(scope="session")
def tiny_bf16_sharded(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "bf16", preset="e2b-mini", dtype="bf16", shards=3, seed=0)


@pytest.fixture
def copy_ckpt(tmp_path):
    def make(src: Path) -> Path:
        dst = tmp_path / "copy"
        shutil.copytree(src, dst)
        return dst

    return make


# Converting takes ~30 s even for a tiny model: one 16-bit and one 4-bit bundle (context 128, the
# converter's defaults otherwise) serve every test file that only reads them; tests that damage a
# bundle work on a copy.


@pytest.fixture(scope="session")
def tiny_bundle16(tiny_e2b, tmp_path_factory) -> Path:
    """Written over a stale OUT with force=True: that conversion is needed anyway, so it doubles
    as the `--force` replacement check (test_convert)."""
    from gemma_ane.convert import ConvertOptions, convert

    out = tmp_path_factory.mktemp("bundle16") / "bundle"
    out.mkdir()
    (out / "stale.txt").write_text("from an older conversion")
    seconds = convert(str(tiny_e2b), str(out), ConvertOptions(context=128, bits=16, force=True), progress=False)
    (out.parent / "seconds.json").write_text(json.dumps(seconds))  # the stage timings, for test_convert
    return out


@pytest.fixture(scope="session")
def tiny_bundle4(tiny_e2b, tmp_path_factory) -> Path:
    from gemma_ane.convert import ConvertOptions, convert

    out = tmp_path_factory.mktemp("bundle4") / "bundle"
    seconds = convert(str(tiny_e2b), str(out), ConvertOptions(context=128, bits=4), progress=False)
    (out.parent / "seconds.json").write_text(json.dumps(seconds))  # the stage timings, for test_convert
    return out
