"""Progress on the CLI's long steps: a line on stderr naming each as it starts, and its time when it ends.

Shown to a person watching (stderr a terminal) unless --quiet; never to a pipe or a test, which read a failure's
one-line error alone.

And `writable`: the check, made before a long step, of a file the command writes only once the step is done."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import InputError


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


def writable(path: str, flag: str) -> None:
    """Refuse, in one line naming `flag`, a FILE the command would write only after its long work: a directory, or
    one whose parent is not a directory it may write in. Found afterwards, the work would be lost."""
    parent = Path(path).parent
    if os.path.isdir(path):
        raise InputError(f"{flag} {path}: is a directory (give a file name)")
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: {parent} is not an existing directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot write in {parent}")
