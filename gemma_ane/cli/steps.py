"""Progress on the CLI's long steps: a line on stderr naming each as it starts, and its time when it ends.

Shown to a person watching (stderr a terminal) unless --quiet; never to a pipe or a test, which read a failure's
one-line error alone."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


def shown(a) -> bool:
    """Whether progress (a step's lines, convert's and eval's bars) is for someone watching."""
    return not getattr(a, "quiet", False) and sys.stderr.isatty()


@contextmanager
def step(a, what: str):
    """`what` (e.g. "loading demo/bundle") on stderr, then its seconds once it is done; nothing on --quiet."""
    if not shown(a):
        yield
        return
    print(f"gemma-ane {a.command}: {what} ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    yield
    print(f"gemma-ane {a.command}: {what}: done in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


def add_quiet(s) -> None:
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr (shown only on a terminal)")
