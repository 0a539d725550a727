"""The documentation: the MkDocs site builds with no broken link or orphan page, and every example marked runnable in
README.md and docs/ prints what it shows, run against the demo bundle (docs/runnable.md states the convention)."""

import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# an HTML comment (invisible on GitHub and in the site) right before a ```console block:
# <!-- runnable -->, <!-- runnable regex -->, <!-- runnable stderr exit=2 -->
MARK = re.compile(r"^<!-- runnable((?: [a-z]+(?:=\d+)?)*) -->\n```console\n(.*?)^```$", re.M | re.S)
OPTIONS = {"regex", "stderr", "exit"}


@dataclass
class Example:
    where: str  # file:line, the test's id
    commands: list  # (command, expected lines)
    regex: bool
    stderr: bool
    exit: int


def parse(path: Path, root: Path = ROOT) -> list[Example]:
    """The runnable examples of one Markdown file, each a list of `$ command` lines with the lines they print."""
    text = path.read_text()
    found = []
    for m in MARK.finditer(text):
        opts = dict(o.partition("=")[::2] for o in m.group(1).split())
        where = f"{path.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}"
        if set(opts) - OPTIONS:
            raise ValueError(f"{where}: unknown runnable option(s) {sorted(set(opts) - OPTIONS)}")
        commands = []
        for line in m.group(2).splitlines():
            if line.startswith("$ "):
                commands.append((line[2:], []))
            elif not commands:
                raise ValueError(f"{where}: output before the first '$ ' command")
            else:
                commands[-1][1].append(line)
        found.append(Example(where, commands, "regex" in opts, "stderr" in opts, int(opts.get("exit") or 0)))
    return found


EXAMPLES = [e for p in SOURCES for e in parse(p)]


def mismatch(expected: list, got: str, regex: bool) -> str | None:
    """Why the printed text is not the shown one (None when it is): line for line, trailing spaces aside; with
    `regex` each shown line is a pattern the printed line must match whole (sampled text)."""
    lines = [line.rstrip() for line in got.rstrip("\n").splitlines()]
    if len(lines) != len(expected):
        return f"{len(lines)} lines printed, {len(expected)} shown:\n" + "\n".join(lines)
    for shown, line in zip(expected, lines):
        if not (re.fullmatch(shown, line) if regex else shown.rstrip() == line):
            return f"shown {shown!r}, printed {line!r}"
    return None


def shims(directory: Path) -> dict:
    """`gemma-ane` and `python` on PATH as this interpreter with this checkout's package (a subprocess inherits the
    environment, so the worktree's gemma_ane is the one the examples run)."""
    for name, argv in (("gemma-ane", f'"{sys.executable}" -m gemma_ane'), ("python", f'"{sys.executable}"')):
        shim = directory / name
        shim.write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, PATH=f"{directory}{os.pathsep}{os.environ['PATH']}", COLUMNS="120")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_at_least_fifteen_examples_are_marked():
    assert len(EXAMPLES) >= 15, [e.where for e in EXAMPLES]
    assert any(e.where.startswith("README.md") for e in EXAMPLES)


def test_mismatch_is_caught():
    assert mismatch(["Paris."], "Paris.\n", regex=False) is None
    assert mismatch(["Paris."], "Rome.\n", regex=False)
    assert mismatch(["Paris."], "Paris.\nRome.\n", regex=False)
    assert mismatch([r"\d+ tokens"], "12 tokens\n", regex=True) is None
    assert mismatch([r"\d+ tokens"], "12 tokens!\n", regex=True)


def test_a_bad_mark_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- runnable loud -->\n```console\n$ true\n```\n")
    with pytest.raises(ValueError, match="unknown runnable option"):
        parse(page, tmp_path)


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-q",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "run" / "index.html").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_example_prints_what_it_shows(example, demo_bundle16, tmp_path):
    (tmp_path / "bin").mkdir()
    env = shims(tmp_path / "bin")
    work = tmp_path / "work"  # the examples' cwd: whatever they write lands here, never in the checkout
    work.mkdir()
    for command, expected in example.commands:
        run = subprocess.run(
            ["bash", "-c", command.replace("demo/bundle", str(demo_bundle16))],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == example.exit, f"{example.where}: $ {command}\n{run.stderr}"
        printed = (run.stderr if example.stderr else run.stdout).replace(str(demo_bundle16), "demo/bundle")
        why = mismatch(expected, printed, example.regex)
        assert why is None, f"{example.where}: $ {command}\n{why}"


def test_benchmarks_table_is_current(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import summary

    assert summary.main(["--check"]) == 0, "BENCHMARKS.md: run python bench/summary.py"
    copy = tmp_path / "BENCHMARKS.md"
    copy.write_text(
        (ROOT / "BENCHMARKS.md").read_text()
        + "\n## start-up — 2099-01-01 00:00\n\n- command: `python bench/startup.py`\n- machine: M\n- versions: v\n\n"
        + "- load and one token: **0.5 s**\n"
    )
    assert summary.main(["--check", "--path", str(copy)]) == 1  # a new entry makes the table stale
    assert summary.main(["--path", str(copy)]) == 0
    assert (
        "| start-up | load and one token: **0.5 s** | M | 2099-01-01 00:00 | `python bench/startup.py` |"
        in (copy.read_text().split("<!-- /current -->")[0])
    )
