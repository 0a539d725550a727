"""Issue 42's one bundle object: `bundle.open(root) -> Bundle` checked and parsed once, openers that take
(bundle, device), the backend choices declared once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import gemma_ane
from gemma_ane import bundle
from gemma_ane.bundle import Bundle, BundleError
from gemma_ane.bundle.schema import AssistantConfig, TextConfig
from gemma_ane.cli import build_parser
from gemma_ane.runtime import device
from gemma_ane.runtime.device import BackendError, Device
from gemma_ane.server.app import _arguments


def reads_of(monkeypatch, name: str) -> list[Path]:
    """Every read of a file called `name` from now on, whoever reads it."""
    seen, read_text, read_bytes = [], Path.read_text, Path.read_bytes
    monkeypatch.setattr(
        Path, "read_text", lambda p, *a, **kw: (p.name == name and seen.append(p)) or read_text(p, *a, **kw)
    )
    monkeypatch.setattr(Path, "read_bytes", lambda p: (p.name == name and seen.append(p)) or read_bytes(p))
    return seen


def test_load_opens_model_config_once(tiny_bundle16, monkeypatch):
    """It was parsed 4 times a load (the check twice, the engine, load itself)."""
    seen = reads_of(monkeypatch, "model_config.json")
    model = gemma_ane.load(tiny_bundle16, backend="mil")
    assert len(seen) == 1, seen
    assert model.generate("hi", max_tokens=1, temperature=0).tokens


def test_open_parses_the_config_into_its_records(tiny_bundle16):
    opened = bundle.open(tiny_bundle16)
    assert isinstance(opened, Bundle) and opened.root == Path(tiny_bundle16)
    assert (
        isinstance(opened.config.text, TextConfig) and opened.config.text.vocab_size == opened.config.raw["vocab_size"]
    )
    assert opened.config.assistant is None or isinstance(opened.config.assistant, AssistantConfig)
    assert [p.name for p in opened.chunks] == ["chunk_1.mlpackage", "chunk_2.mlpackage", "chunk_3.mlpackage"]
    assert opened.tokenizer.is_file() and opened.manifest is not None


def test_open_refuses_a_damaged_bundle_in_one_line_naming_the_field(tiny_bundle16, tmp_path):
    root = tmp_path / "b"
    shutil.copytree(tiny_bundle16, root)
    (root / "manifest.json").unlink()  # else its size check speaks first
    config = json.loads((root / "model_config.json").read_text())
    (root / "model_config.json").write_text(json.dumps({**config, "vocab_size": -1}))
    with pytest.raises(BundleError, match=r"model_config.json: vocab_size=-1: expected a positive integer") as e:
        bundle.open(root)
    assert "\n" not in str(e.value)
    with pytest.raises(BundleError, match="vocab_size=-1"):
        bundle.open(root, check=False)  # the rules hold without the file check too


def test_a_device_is_picked_once_and_checked():
    assert Device.of("mil", "fp32") == Device("mil", "fp32", "cpu_and_ne")
    with pytest.raises(BackendError, match=r"backend='gpu': choose auto, coreml, mil"):
        Device.of("gpu")


def test_the_backend_choices_are_declared_once():
    """The CLI's and the server's --backend choices are device.BACKENDS itself, not lists of their own."""
    import argparse

    from gemma_ane.cli import run
    from gemma_ane.server import app

    assert run.BACKENDS is device.BACKENDS and app.BACKENDS is device.BACKENDS
    server = argparse.ArgumentParser()
    _arguments(server)
    serve = next(a for a in server._actions if a.dest == "backend")
    generate = build_parser().parse_args(["generate", "b", "--prompt", "x"])
    assert serve.choices is device.BACKENDS and generate.backend in device.BACKENDS
