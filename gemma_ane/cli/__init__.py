"""`gemma-ane`: a thin shell over the Python API. Every failure the user can cause is one line
on stderr and exit status 2 (`check` and `inspect --ane` findings: 1; an unverifiable bundle: 3;
a signal: 128+N; a closed pipe ends quietly); nothing here computes anything itself."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import warnings
from contextlib import contextmanager

from .. import __version__, files
from ..errors import GemmaAneError, as_typed, option_strings
from . import build, chat, proof, run


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help states it already (in its own words) or there is
    none to show (None, False, an empty list: the option is simply off)."""

    def _get_help_string(self, action):
        text, d = action.help or "", action.default
        off = d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, list) and not d)
        if action.option_strings and not off and "default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse prints the whole usage block on a bad flag; we keep errors to one line. Every command's help
    shows each option's default (_HelpFormatter)."""

    def __init__(self, *args, formatter_class=_HelpFormatter, **kw):
        super().__init__(*args, formatter_class=formatter_class, **kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gemma-ane", description="Gemma 4 E2B for the Apple Neural Engine")
    p.add_argument("--version", action="version", version=f"gemma-ane {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for commands in (build, run):
        commands.add_commands(sub)
    chat.add_command(sub)
    from ..server import app  # its web stack is imported only when `serve` runs

    app.add_parser(sub)
    proof.add_commands(sub)
    return p


# modules behind an extra, and the extra that brings them
_OPTIONAL = {
    "torch": "convert",
    "safetensors": "convert",
    "transformers": "dev",
    "starlette": "serve",
    "uvicorn": "serve",
    "sklearn": "dev",
}


STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop(signum, frame):
    for s in STOPPING:  # a second signal must not interrupt the cleanup
        signal.signal(s, signal.SIG_IGN)
    files.stop(signum, frame)


@contextmanager
def _stoppable():
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return
    saved = {s: signal.signal(s, _stop) for s in STOPPING}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _flags(parser: argparse.ArgumentParser, command: str) -> set[str]:
    """The option strings of one subcommand."""
    return option_strings(
        next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    )


def _closed_stream(command: str) -> str | None:
    """The standard stream `command` needs that the shell closed (`>&-`, `<&-`; Python leaves it None), as
    `ls >&-` refuses to run blind: every command but serve (which logs to stderr) prints its result, and chat
    reads the conversation. None when both are there."""
    if sys.stdout is None and command != "serve":
        return "standard output is closed (the result would have nowhere to go)"
    if sys.stdin is None and command == "chat":
        return "standard input is closed (chat reads the conversation from it)"
    return None


class _Stderr(logging.Handler):
    """The library's log lines (which backend `auto` picked) on stderr as the command's notes: whatever sys.stderr
    is when one is written (tests swap it)."""

    def emit(self, record):
        print(self.format(record), file=sys.stderr)


def main(argv=None) -> int:
    """The command: the library's INFO lines shown on stderr while it runs (an app that calls main keeps its own
    logging after)."""
    log, handler = logging.getLogger("gemma_ane"), _Stderr()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        return _main(argv)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _main(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # warnings (a function the device refuses, a bundle's RoPE tables) as one line, not a source dump
    warnings.formatwarning = lambda message, *_, **__: f"gemma-ane {args.command}: warning: {message}\n"
    closed = _closed_stream(args.command)
    if closed:
        print(f"gemma-ane {args.command}: error: {closed}", file=sys.stderr)
        return 2
    try:
        with _stoppable():
            try:
                rc = args.fn(args) or 0
            except Exception:
                files.stop_point()  # a failure that follows a swallowed signal is the signal's doing
                raise
            sys.stdout.flush()  # a reader that left shows here, not in the flush at exit
        return rc
    except BrokenPipeError:
        # `gemma-ane plan | head`: the reader has what it wanted; end quietly as Unix tools do, and
        # point stdout at devnull so the interpreter's last flush does not complain either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (KeyboardInterrupt, files.Stopped) as e:
        signum = e.args[0] if isinstance(e, files.Stopped) else signal.SIGINT
        print(f"gemma-ane {args.command}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except (GemmaAneError, ValueError, OSError) as e:  # ValueError, OSError: numpy's, the file system's
        print(f"gemma-ane {args.command}: error: {as_typed(str(e), _flags(parser, args.command))}", file=sys.stderr)
        return e.exit_code if isinstance(e, GemmaAneError) else 2
    except ImportError as e:
        if (e.name or "").split(".")[0] not in _OPTIONAL:
            raise
        print(
            f"gemma-ane {args.command}: error: {e.name} is not installed "
            f"(pip install 'gemma-ane[{_OPTIONAL[e.name.split('.')[0]]}]')",
            file=sys.stderr,
        )
        return 2
