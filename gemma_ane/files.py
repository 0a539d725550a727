"""Reading and writing the small files of checkpoints and bundles: JSON, hashes, atomic writes.

Every write is whole or absent: a reader (or a crash) never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import InputError


class FileFormatError(InputError):
    """A file that cannot be read as what it should be, or written where it should go; the
    message names the file."""


def read_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FileFormatError(f"{path}: unreadable JSON ({e})") from None
    except RecursionError:  # the parser recurses once per level: a damaged file can nest past Python's stack
        raise FileFormatError(f"{path}: unreadable JSON (nested too deeply)") from None


def read_json_object(path: str | Path) -> dict:
    """read_json of a file that must hold an object (a config, a manifest): anything else is the file's fault,
    named here rather than as an AttributeError wherever the first `.get` meets it."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise FileFormatError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def open_regular(path: str | Path, limit: int, error: type[Exception] = FileFormatError, name: str | None = None):
    """`path` opened for binary reading if it is a regular file of at most `limit` bytes, else `error` naming it
    (`name`, default the path) and why. Opened without blocking, so a FIFO is refused rather than waited on; the
    size is the open file's, so a name swapped after the check changes nothing."""
    name = name or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:  # the file system's answer: no such file, no permission, a loop of links
        raise error(f"{name}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise error(f"{name}: Is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{name}: not a regular file (a {_file_kind(st.st_mode)})")
        if st.st_size > limit:
            raise error(f"{name}: {st.st_size} bytes, more than the limit of {limit}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))
    return next((name for test, name in kinds if test(mode)), "socket")


def read_regular(path: str | Path, limit: int, error: type[Exception] = FileFormatError, name: str | None = None):
    """The bytes of `path`, a regular file of at most `limit` bytes (open_regular); a file that grows past the
    limit while it is read is refused too, so no more than limit + 1 bytes are ever read."""
    with open_regular(path, limit, error, name) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{name or path}: more than the limit of {limit} bytes")
    return data


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (text, or bytes) beside `path`, then rename it over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        mode = {"mode": "w", "encoding": "utf-8", "newline": "\n"} if isinstance(data, str) else {"mode": "wb"}
        with os.fdopen(fd, **mode) as handle:
            handle.write(data)
            os.fchmod(handle.fileno(), 0o644)  # mkstemp makes it private; these files are shared
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: str | Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def tree_size(path: str | Path) -> int:
    """Bytes of a file, or of every file below a directory (a package or a bundle)."""
    path = Path(path)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def is_within(path: str | Path, root: str | Path) -> bool:
    """`path` is `root` or lies below it. Directories are compared by identity (device and inode), not
    by name, so symlinks, `..` and case-insensitive file systems do not hide it; `path` need not exist."""
    try:
        target = os.stat(root)
    except OSError:
        return False
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError):  # a loop of symbolic links leads nowhere, so not below `root`
        return False
    for p in (resolved, *resolved.parents):
        try:
            if os.path.samestat(os.stat(p), target):
                return True
        except OSError:
            continue  # the part of `path` not yet created
    return False


@contextmanager
def building(out: str | Path):
    """Yield a hidden sibling directory of `out` to fill. On success it replaces `out` (one rename,
    and files readable as any other's); on any failure, Ctrl-C included, it is removed and `out`
    is left as it was."""
    out = Path(out)
    # named before it exists, so an interrupt at any instant leaves nothing the cleanup cannot name
    tmp = out.parent / f".{out.name}.partial-{secrets.token_hex(8)}"  # 64 random bits: no clash
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir(mode=0o700)
        except OSError as e:
            raise FileFormatError(f"{out}: cannot write here ({e.strerror or e})") from None
        yield tmp
        stop_point()  # a signal whose exception some library swallowed still cancels the result
        _make_shareable(tmp)  # mkdtemp (and coremltools) create private files
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_shareable(root: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for p in root.rglob("*"):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


# -- signals ---------------------------------------------------------------------------------------


class Stopped(BaseException):
    """A signal (SIGINT, SIGTERM, SIGHUP) as an exception, so the same cleanup runs as for any failure
    (`building`'s partial directory, temporary files); args[0] is the signal number. Not an Exception:
    `except Exception` does not swallow it."""


_received: list[int] = []


def stop(signum, frame=None):
    """The CLI's signal handler. The signal is also remembered: a library's bare `except:` can swallow the
    exception, and `stop_point` raises it again where the work can still be abandoned."""
    _received.append(signum)
    raise Stopped(signum)


def stop_point() -> None:
    if _received:
        raise Stopped(_received[0])
