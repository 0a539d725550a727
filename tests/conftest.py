import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

FIXTURES = Path(__file__).parent / "fixtures"

# The executor fails at the first op that produces inf or NaN (mil.MILModel, strict): on the Neural
# Engine a non-finite fp16 value silently corrupts what follows. Subprocesses inherit it.
os.environ["GEMMA_ANE_STRICT"] = "1"

# Fixtures that convert a bundle (each conversion costs 30-60 s): every test that uses one, directly
# or through another fixture, is slow; so are tests marked by hand (a conversion of their own, or a
# long oracle run). `pytest -m "not slow"` is the fast loop; CI runs everything.
CONVERTING = {
    "tiny_bundle16",
    "tiny_bundle4",
    "tiny_published",
    "vision_bundle",
    "audio_bundle",
    "bundle",
    "bundle16",
    "bundle4",
    "gqa16",
    "e4b_bundle16",
    "e2b_full16",
    "e2b_full4",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if CONVERTING & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def e2b_config() -> dict:
    """The real gemma-4-E2B-it config.json (CONTRACT §1)."""
    return json.loads((FIXTURES / "e2b_config.json").read_text())


def built_once(factory, name: str, build) -> Path:
    """`build(dir)` once per test run; returns `dir`. Under pytest-xdist (scripts/test.sh runs two
    workers) each worker has its own session, so the first to get here builds into the run's
    shared temporary directory and the others wait for it: a bundle is converted once, not twice."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    out, done = base / name, base / f"{name}.done"
    with FileLock(f"{out}.lock"):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # what a failed attempt left
            out.mkdir()
            build(out)
            done.touch()
    return out


def _tiny(factory, name, **kw):
    from gemma_ane.oracle.tiny import write_tiny

    return built_once(factory, name, lambda d: write_tiny(d / "ckpt", **kw)) / "ckpt"


@pytest.fixture(scope="session")
def tiny_e2b(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "e2b", preset="e2b-mini")


@pytest.fixture(scope="session")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """e2b-mini (tiny_e2b's weights) and its matched drafter, as `gemma-ane tiny CKPT --assistant ASST` writes them."""
    from gemma_ane.oracle.tiny import write_tiny

    d = built_once(tmp_path_factory, "pair", lambda d: write_tiny(d / "ckpt", preset="e2b-mini", assistant=d / "asst"))
    return d / "ckpt", d / "asst"


@pytest.fixture(scope="session")
def tiny_gqa(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "gqa", preset="gqa-mini")


@pytest.fixture(scope="session")
def tiny_e4b(tmp_path_factory) -> Path:
    """e4b-mini: E4B's structure (two KV heads, no double-wide MLP) at tiny size."""
    return _tiny(tmp_path_factory, "e4b", preset="e4b-mini")


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


def _convert(src: Path, out: Path, **options) -> None:
    """Convert into `out`, and keep the stage timings beside it (for test_convert). Text only unless asked: the
    vision and audio models cost a conversion of their own (`vision_bundle`, `audio_bundle`)."""
    from gemma_ane.convert import ConvertOptions, convert

    options = {"context": 128, "vision": False, "audio": False, **options}
    seconds = convert(str(src), str(out), ConvertOptions(**options), progress=False)
    (out.parent / "seconds.json").write_text(json.dumps(seconds))


@pytest.fixture(scope="session")
def tiny_bundle16(tiny_e2b, tmp_path_factory) -> Path:
    """Written over a stale OUT with force=True: that conversion is needed anyway, so it doubles
    as the `--force` replacement check (test_convert)."""

    def build(d: Path):
        (d / "bundle").mkdir()
        (d / "bundle" / "stale.txt").write_text("from an older conversion")
        _convert(tiny_e2b, d / "bundle", bits=16, force=True)

    return built_once(tmp_path_factory, "bundle16", build) / "bundle"


@pytest.fixture(scope="session")
def vision_bundle(e2b_full16) -> Path:
    """16-bit chunks and vision model, 70 soft tokens per image, a context of 256 (two images and text): e2b_full16,
    whose drafter drafts only when a test asks (`draft_tokens`), so a conversion of its own would repeat it."""
    return e2b_full16


@pytest.fixture(scope="session")
def tiny_audio(tmp_path_factory) -> Path:
    """e2b-audio-mini: e2b-mini's text model with an audio tower that runs, and a tokenizer with audio tokens."""
    return _tiny(tmp_path_factory, "e2b_audio", preset="e2b-audio-mini")


@pytest.fixture(scope="session")
def audio_bundle(tiny_audio, tmp_path_factory) -> Path:
    """16-bit chunks and audio model (as vision_bundle's: at 8 bits the tiny tower's soft tokens move 1.2%, which
    the random text model turns into a text-row cosine of 0.977), buckets of 1 and 2 s (two functions: the bucket
    choice is exercised), a context of 256 (two clips and text)."""

    def build(d: Path):
        _convert(tiny_audio, d / "bundle", bits=16, context=256, audio=True, audio_bits=16, audio_seconds=(1.0, 2.0))

    return built_once(tmp_path_factory, "audio_bundle", build) / "bundle"


@pytest.fixture(scope="session")
def tiny_bundle4(tiny_e2b, tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "bundle4", lambda d: _convert(tiny_e2b, d / "bundle", bits=4)) / "bundle"


def _convert_fresh(src: Path, out: Path, **options) -> None:
    """_convert in a fresh process: a test that installed the Core ML stand-in (tests/coreml_standin.py) leaves
    coremltools' state in its worker changed, which changes a saved model.mlmodel, and test_byte_identity hashes
    the bundles built this way against the recorded ones."""
    code = "import json, sys; from pathlib import Path; from conftest import _convert; "
    code += "_convert(Path(sys.argv[1]), Path(sys.argv[2]), **json.loads(sys.argv[3]))"
    run = subprocess.run(
        [sys.executable, "-c", code, str(src), str(out), json.dumps(options)],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.fixture(scope="session")
def tiny_published(tiny_e2b, tmp_path_factory) -> Path:
    """The published layout (argmax head, no KV-only prefill, no manifest) at the 16-bit bundle's options, as
    tests/bundle_hashes.py converts its e2b-mini-published case (force=True, a fresh process): test_byte_identity
    hashes this one."""

    def build(d: Path):
        _convert_fresh(tiny_e2b, d / "bundle", bits=16, layout="published", force=True)

    return built_once(tmp_path_factory, "published", build) / "bundle"


@pytest.fixture(scope="session")
def e2b_full16(pair, tmp_path_factory) -> Path:
    """e2b-mini with its drafter and its vision model (70 soft tokens), 16 bits, a context of 256, the default three
    chunks: tests/bundle_hashes.py's e2b-mini-16bit case as it converts it (force=True, a fresh process, the audio
    option left at its default), so test_byte_identity hashes it; test_nchunks compares its 4 and 6 chunks to it,
    test_drafter and test_bench read its drafter. Read only: tests that damage it copy it."""
    ckpt, asst = pair
    options = dict(bits=16, context=256, vision=True, image_tokens=70, audio=True, assistant=str(asst), force=True)
    return (
        built_once(tmp_path_factory, "e2b_full16", lambda d: _convert_fresh(ckpt, d / "bundle", **options)) / "bundle"
    )


@pytest.fixture(scope="session")
def e2b_full4(pair, tmp_path_factory) -> Path:
    """tests/bundle_hashes.py's e2b-mini-4bit case as it converts it (its options, force=True, a fresh process):
    test_byte_identity hashes it, test_drafter reads its 4-bit drafter. Read only."""
    from bundle_hashes import CASES

    ckpt, asst = pair
    options = dict(CASES["e2b-mini-4bit"][2], audio=True, assistant=str(asst), force=True)  # audio: the default
    return built_once(tmp_path_factory, "e2b_full4", lambda d: _convert_fresh(ckpt, d / "bundle", **options)) / "bundle"


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory) -> Path:
    """The `demo` preset (its shipped trained weights: tiny_train.WEIGHTS), written once per run."""
    return _tiny(tmp_path_factory, "demo", preset="demo")


@pytest.fixture(scope="session")
def demo_bundle16(demo_ckpt, tmp_path_factory) -> Path:
    """The demo checkpoint converted as the demo converts it: 16-bit, a context of 512 (a tool declaration fits),
    with its vision model (test_demo_model audits it and proves an image prompt on it)."""
    return (
        built_once(
            tmp_path_factory,
            "demo_bundle16",
            lambda d: _convert(demo_ckpt, d / "bundle", bits=16, context=512, vision=True),
        )
        / "bundle"
    )


@pytest.fixture(scope="session")
def e4b_bundle16(tiny_e4b, tmp_path_factory) -> Path:
    """e4b-mini at 16 bits in the default three chunks, a context of 256: test_e4b's bundle, and test_nchunks'
    three-chunk one (whose split is the default)."""
    return (
        built_once(tmp_path_factory, "e4b_bundle16", lambda d: _convert(tiny_e4b, d / "bundle", bits=16, context=256))
        / "bundle"
    )
