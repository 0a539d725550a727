import json
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def e2b_config() -> dict:
    """The real gemma-4-E2B-it config.json (SPEC §1)."""
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
