"""The package's errors: every error a user can meet derives from `GemmaAneError`, and its class says how
it is reported: `exit_code` for the CLI (one line, then that code), `status` for the server (one mapping,
`server._error_of`), `code` for OpenAI's error object. No imports of our own, so any module may use it.

The subclasses keep the builtin base each family had before (ValueError, RuntimeError), so an
`except ValueError` written against them still catches them. A builtin exception is raised only where no user
input reaches (a bug if it fires, or caught at once), with a `# internal: why` comment on it or alone above it;
tests/test_errors.py walks the source for any other."""

import re


class GemmaAneError(Exception):
    """An error a user can meet; the message names the problem (file, field, value) on one line."""

    exit_code = 2  # the CLI's exit code: the run failed for a reason the message states
    status = 500  # the server's HTTP status when a request meets it
    code: str | None = None  # OpenAI's `error.code`
    param: str | None = None  # the request field at fault, where one is known


class InputError(GemmaAneError, ValueError):
    """A request's or a user's input that cannot be used (sampling, messages, images, tools, files)."""

    status = 400


class BundleError(GemmaAneError, ValueError):
    """A bundle that is missing or damaged; the message names the file. The server's fault, not the request's."""


class DeviceError(GemmaAneError, RuntimeError):
    """A backend or executor that cannot run a bundle here, or an output it should never give (NaN logits)."""


class ConversionError(GemmaAneError, ValueError):
    """A config, checkpoint or option the converter cannot turn into a bundle."""


# the API's keyword where its command-line flag is spelled otherwise
FLAG_OF = {"draft_tokens": "--draft"}


def option_strings(parser) -> set[str]:
    """Every flag an argparse parser (or subparser) takes: the `flags` as_typed may name."""
    return {f for action in parser._actions for f in action.option_strings}


def as_typed(message: str, flags: set[str]) -> str:
    """A message that opens with the API's keyword (`max_tokens=-1: ...` or `logit_bias: ...`, as the Python API
    raises it), opened with the flag a command-line user typed instead (`--max-tokens -1: ...`, `--logit-bias: ...`)
    where `flags` (the command's) has one."""
    head = re.match(r"([A-Za-z_]\w*)([=:])", message)
    if head is None:
        return message
    name, sep = head.groups()
    flag = FLAG_OF.get(name, "--" + name.replace("_", "-"))
    if flag not in flags:
        return message
    rest = message[head.end() :]
    return f"{flag} {rest}" if sep == "=" else f"{flag}:{rest}"
