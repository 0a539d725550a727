"""Shared by the benchmark scripts: where a run happened, and appending it to BENCHMARKS.md."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem = float("nan")
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB, {cpu}"


def versions() -> str:
    out = []
    for pkg in ("gemma-ane", "numpy", "torch", "coremltools", "transformers"):
        try:
            out.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def record(title: str, body: str, path: Path = ROOT / "BENCHMARKS.md") -> None:
    """Append one entry: command, date, machine, versions, then the figures."""
    cmd = " ".join(shlex.quote(x) for x in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    entry = (
        f"\n## {title} — {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
        f"- command: `python {cmd}`\n- machine: {machine()}\n- versions: {versions()}\n\n{body}\n"
    )
    new = not path.exists()
    with open(path, "a") as f:
        if new:
            f.write("# Benchmarks\n\nEvery entry is appended by a script in `bench/` (see bench/README.md).\n")
        f.write(entry)


def publish(title: str, body: str, args) -> None:
    """Print the figures; append them to BENCHMARKS.md only when asked (--record), never in --quick mode."""
    print(body)
    if getattr(args, "record", False) and not getattr(args, "quick", False):
        record(title, body)


def tiny_bundle(tmp: Path, bits: int) -> Path:
    """An e2b-mini checkpoint converted at context 128: what --quick modes run on."""
    from gemma_ane.convert import ConvertOptions, convert
    from gemma_ane.oracle.tiny import write_tiny

    write_tiny(tmp / "ckpt", preset="e2b-mini")
    convert(
        str(tmp / "ckpt"), str(tmp / "bundle"), ConvertOptions(context=128, bits=bits, vision=False), progress=False
    )
    return tmp / "bundle"
