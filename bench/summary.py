"""The current table at the top of BENCHMARKS.md, generated from the entries below it: for each benchmark (an
entry's title, what it measures and the command's options), its newest entry's headline figure (the first line
that states a bold figure), with the machine, date and command it was measured with.

    python bench/summary.py           # rewrite the table in BENCHMARKS.md
    python bench/summary.py --check   # exit 1 if the table is not what the entries give (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- current: written by python bench/summary.py from the entries below; edit those, not this -->"
END = "<!-- /current -->"
ENTRY = re.compile(r"^## (?P<title>.+?) — (?P<date>\d{4}-\d\d-\d\d \d\d:\d\d)$", re.M)


def entries(text: str) -> list[dict]:
    """Each `## title — date` entry of the history: title, date, command, machine, and its headline line."""
    found = []
    heads = list(ENTRY.finditer(text))
    for m, nxt in zip(heads, [*heads[1:], None]):
        body = text[m.end() : nxt.start() if nxt else len(text)]
        field = {k: re.search(rf"^- {k}: (.+)$", body, re.M) for k in ("command", "machine")}
        headline = next(
            (ln.strip().removeprefix("- ") for ln in body.splitlines() if "**" in ln and not ln.startswith("|")), None
        )
        if headline and all(field.values()):
            found.append(
                {"title": m["title"], "date": m["date"], "headline": headline} | {k: v[1] for k, v in field.items()}
            )
    return found


def key(entry: dict) -> tuple:
    """What makes two entries the same benchmark: the title, what the headline measures (its words before the first
    figure) and the command's options, where its files and --record / --dir (where it ran) do not count."""
    words = entry["command"].strip("`").split()
    options = tuple(w for w in words if w.startswith("--") and w not in ("--record", "--dir"))
    return entry["title"], entry["headline"].split("**")[0], options


def table(text: str) -> str:
    """The newest entry of each (title, command), oldest benchmark first, as a Markdown table."""
    newest = {}
    for e in entries(text):
        newest[key(e)] = e  # entries are appended in time order: the last one wins
    rows = sorted(newest.values(), key=lambda e: e["date"])
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731 - a figure may hold a pipe
    lines = ["| benchmark | figure | machine | date | command |", "|---|---|---|---|---|"]
    lines += [
        f"| {cell(e['title'])} | {cell(e['headline'])} | {cell(e['machine'])} | {e['date']} | {cell(e['command'])} |"
        for e in rows
    ]
    return "\n".join(lines)


def rewrite(text: str) -> str:
    """BENCHMARKS.md with its current table replaced (or placed under the file's introduction)."""
    history = re.sub(rf"{re.escape(BEGIN)}.*?{re.escape(END)}\n\n", "", text, flags=re.S)
    block = f"{BEGIN}\n\n## Current figures\n\n{table(history)}\n\nThe history, newest last, follows.\n\n{END}\n\n"
    first = ENTRY.search(history)
    at = first.start() if first else len(history)
    return history[:at] + block + history[at:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the table is stale; write nothing")
    p.add_argument("--path", type=Path, default=ROOT / "BENCHMARKS.md")
    a = p.parse_args(argv)
    text = a.path.read_text()
    new = rewrite(text)
    if a.check:
        if new != text:
            print(f"{a.path}: the current table is stale: run python bench/summary.py", file=sys.stderr)
            return 1
        return 0
    a.path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
