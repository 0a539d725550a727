"""The files a package names (issue 43, item 2): Manifest.json's root model path, model.mlmodel and weights/weight.bin
are read only inside the package, as regular files within their bounds. A bundle whose package points at a file
outside it, a FIFO or a device is refused by every command in one line naming the package and the file, and `check`
fails it even when its manifest was rewritten to match: what `check` hashes is what runs.

Each case damages a copy of the shared 16-bit bundle and rewrites its manifest, as whoever shares such a bundle
would."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

import gemma_ane
from gemma_ane.bundle import BundleError
from gemma_ane.bundle.check import write_manifest
from gemma_ane.cli import main
from gemma_ane.mil.package import Package, PackageError

DATA = "chunk_2.mlpackage/Data"
MODEL = f"{DATA}/com.apple.CoreML/model.mlmodel"
WEIGHT = f"{DATA}/com.apple.CoreML/weights/weight.bin"


def set_root_path(bundle: Path, path: str) -> None:
    manifest = bundle / "chunk_2.mlpackage/Manifest.json"
    spec = json.loads(manifest.read_text())
    spec["itemInfoEntries"][spec["rootModelIdentifier"]]["path"] = path
    manifest.write_text(json.dumps(spec))


def outside_copy(bundle: Path, rel: str) -> Path:
    out = bundle.parent / f"outside-{Path(rel).name}"
    shutil.copy(bundle / rel, out)
    return out


def symlink_out(bundle: Path, rel: str) -> None:
    target = outside_copy(bundle, rel)
    (bundle / rel).unlink()
    (bundle / rel).symlink_to(target)


def fifo(bundle: Path, rel: str) -> None:
    (bundle / rel).unlink()
    os.mkfifo(bundle / rel)


# name: (damage, the file the message names, what it says)
CASES = {
    "root path up and out": (
        lambda b: outside_copy(b, MODEL) and set_root_path(b, "../../outside-model.mlmodel"),
        "Manifest.json: itemInfoEntries",
        "lies outside the package",
    ),
    "root path at /dev/zero": (
        lambda b: set_root_path(b, "../" * 12 + "dev/zero"),
        "Manifest.json: itemInfoEntries",
        "lies outside the package (/dev/zero)",
    ),
    "root path absolute": (
        lambda b: set_root_path(b, "/dev/zero"),
        "Manifest.json: itemInfoEntries",
        "is not a path relative to Data/",
    ),
    # `check` and load(verify=True) may say it of the bundle's manifest entry first: "lies outside the bundle"
    "model.mlmodel a symlink out": (lambda b: symlink_out(b, MODEL), "model.mlmodel", "lies outside the"),
    "model.mlmodel a FIFO": (lambda b: fifo(b, MODEL), "model.mlmodel", "not a regular file"),
    "weight.bin a symlink out": (lambda b: symlink_out(b, WEIGHT), "weight.bin", "lies outside the"),
    "weight.bin a FIFO": (lambda b: fifo(b, WEIGHT), "weights/weight.bin", "not a regular file"),
    "weight.bin a symlink to /dev/zero": (
        lambda b: (b / WEIGHT).unlink() or (b / WEIGHT).symlink_to("/dev/zero"),
        "weights/weight.bin",
        "lies outside the package (/dev/zero)",
    ),
}


@contextlib.contextmanager
def never_hangs(bundle: Path):
    """Should a reader block on one of the bundle's FIFOs, a writer opens and closes it after a while: the test then
    fails on the message, rather than hanging the suite."""
    fifos = [p for p in bundle.rglob("*") if p.is_fifo()]
    rescue = threading.Timer(30, lambda: [open(p, "wb").close() for p in fifos])
    rescue.start()
    try:
        yield
    finally:
        rescue.cancel()


@pytest.fixture
def hostile(tiny_bundle16, tmp_path, request):
    bundle = Path(shutil.copytree(tiny_bundle16, tmp_path / "bundle", symlinks=True))
    damage, file, says = CASES[request.param]
    damage(bundle)
    header = {k: v for k, v in json.loads((bundle / "manifest.json").read_text()).items() if k != "files"}
    write_manifest(bundle, header)  # the manifest agrees with the damaged files
    return bundle, file, says


def one_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("hostile", list(CASES), indirect=True)
def test_every_command_refuses_in_one_line_naming_package_and_file(hostile, capsys):
    bundle, file, says = hostile
    package = bundle / "chunk_2.mlpackage"

    def named(text: str) -> bool:
        return any(str(package) in line and file in line and says in line for line in text.splitlines())

    with never_hangs(bundle):
        assert main(["check", str(bundle)]) == 1
        out, err = capsys.readouterr()
        assert named(err), err
        for verify in (False, True):
            with pytest.raises(BundleError) as e:
                gemma_ane.load(bundle, backend="mil", verify=verify)
            assert named(str(e.value)) and "\n" not in str(e.value), e.value
        for command in (
            ["inspect", str(bundle)],
            ["inspect", str(bundle), "--ane"],
            ["generate", str(bundle), "-p", "Hi", "--backend", "mil"],
        ):
            assert main(command) != 0, command
            if command[-1] == "--ane":  # the audit fails a package it cannot read in its report (stdout), exit 1
                out, err = capsys.readouterr()
                assert named(out) and "Traceback" not in err, (out, err)
            else:
                assert named(one_line(capsys)), command
        from gemma_ane.server.app import main as serve

        assert serve([str(bundle), "--backend", "mil"]) == 2
        assert named(one_line(capsys))


def test_a_package_of_regular_files_inside_it_is_read(tiny_bundle16):
    package = Package.open(tiny_bundle16 / "chunk_2.mlpackage")
    package.check_files()
    assert package.program().functions


def test_a_symlink_that_stays_inside_the_package_is_read(tiny_bundle16, tmp_path):
    package = Path(shutil.copytree(tiny_bundle16 / "chunk_2.mlpackage", tmp_path / "c.mlpackage"))
    model = package / "Data/com.apple.CoreML/model.mlmodel"
    model.rename(package / "Data/model.mlmodel")
    model.symlink_to("../model.mlmodel")
    Package.open(package).check_files()
    with pytest.raises(PackageError, match=r"c.mlpackage: Data/com.apple.CoreML/model.mlmodel: No such file"):
        (package / "Data/model.mlmodel").unlink() or Package.open(package)
