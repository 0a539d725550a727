"""One error hierarchy (gemma_ane/errors.py): every exception class the package defines derives from
GemmaAneError, and its class alone says how it is reported: the CLI prints one line and exits with
`exit_code`, the server answers with `status`, `code` and `param`."""

from __future__ import annotations

import ast
import builtins
import importlib

import pytest
from test_server import CHAT, FakeModel, assert_openai_error
from test_walls import modules

from gemma_ane import cli, errors
from gemma_ane.bundle import BundleError
from gemma_ane.bundle.spec import ConfigError
from gemma_ane.convert.checkpoint import CheckpointError
from gemma_ane.convert.options import ConvertError
from gemma_ane.errors import ConversionError, DeviceError, GemmaAneError, InputError
from gemma_ane.files import FileFormatError
from gemma_ane.mil.executor import ExecutionError
from gemma_ane.mil.package import PackageError
from gemma_ane.runtime.backend import BackendError
from gemma_ane.runtime.chat import ChatError, InvalidText, StopError, TooDeep
from gemma_ane.runtime.engine import Cancelled, ContextOverflow, FunctionUnavailable, NonFiniteOutput
from gemma_ane.runtime.grammar import GrammarError
from gemma_ane.runtime.images import ImageError
from gemma_ane.runtime.prompt_cache import PromptCacheError
from gemma_ane.runtime.sampling import SamplingError
from gemma_ane.runtime.tools import ToolError
from gemma_ane.server.app import APIError, build_app
from gemma_ane.server.fetch import FetchError

# exception classes that are not errors a user meets, each with why
EXEMPT = {
    "files.Stopped": "a signal as an exception: a BaseException so that `except Exception` never swallows it",
}


def _is_exception(base: ast.expr, module) -> bool:
    """Whether a base, as written, names an exception class (ours, or a builtin one)."""
    name = ast.unparse(base)
    obj = getattr(module, name, None) if module is not None else None
    obj = obj if obj is not None else getattr(builtins, name, None)
    return isinstance(obj, type) and issubclass(obj, BaseException)


def exception_classes() -> dict[str, type | None]:
    """Every exception class defined in gemma_ane, by `module.Class`: the class itself, or None for one
    defined inside a function (which the walk cannot reach, so it is reported as such)."""
    found = {}
    for name, path in modules().items():
        module = importlib.import_module("gemma_ane" + (f".{name}" if name else ""))
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(_is_exception(b, module) for b in node.bases):
                found[f"{name}.{node.name}"] = getattr(module, node.name) if id(node) in top else None
    return found


def test_every_exception_class_derives_from_the_base():
    found = exception_classes()
    assert len(found) > 20 and "runtime.engine.ContextOverflow" in found  # the walk does see them
    outside = sorted(n for n, cls in found.items() if n not in EXEMPT and not (cls and issubclass(cls, GemmaAneError)))
    assert not outside, f"not GemmaAneErrors: {outside}"
    assert set(EXEMPT) <= set(found), "an exemption names a class that no longer exists"
    assert not issubclass(found["files.Stopped"], Exception)


def test_the_families_keep_their_builtin_bases():
    """`except ValueError` written before the hierarchy still catches what it caught."""
    for cls in (SamplingError, ChatError, ImageError, ToolError, GrammarError, ContextOverflow, PromptCacheError):
        assert issubclass(cls, InputError) and issubclass(cls, ValueError)
    for cls in (BundleError, PackageError, BackendError):
        assert issubclass(cls, errors.BundleError) and issubclass(cls, ValueError)
    for cls in (ConfigError, CheckpointError, ConvertError):
        assert issubclass(cls, ConversionError) and issubclass(cls, ValueError)
    for cls in (NonFiniteOutput, FunctionUnavailable, ExecutionError, BackendError):
        assert issubclass(cls, DeviceError) and issubclass(cls, RuntimeError)
    assert issubclass(ExecutionError, ValueError) and issubclass(FileFormatError, ValueError)
    assert not issubclass(FetchError, ValueError)  # fetch wraps the ValueErrors it meets in FetchErrors
    assert ContextOverflow.code == "context_length_exceeded"


# a sample of each family, with what the CLI and the server make of it
SAMPLES = [
    (SamplingError("temperature=-1: must be >= 0", param="temperature"), 400, "temperature", None),
    (ContextOverflow("a prompt of 99 tokens would exceed the context of 64"), 400, None, "context_length_exceeded"),
    (ImageError("messages[0].content[1]: not an image"), 400, "messages[0].content[1]", None),
    (ToolError("tools[0].function", "expected an object"), 400, "tools[0].function", None),
    (TooDeep("messages[0].content"), 400, "messages[0].content", None),
    (StopError("stop: 5 strings"), 400, "stop", None),
    (InvalidText("a lone surrogate"), 400, None, None),
    (GrammarError("response_format: not a schema", param="response_format"), 400, "response_format", None),
    (PromptCacheError("cache.npz: made by another bundle"), 400, None, None),
    (FileFormatError("notes.json: unreadable JSON"), 400, None, None),
    (FetchError("HTTP 404 Not Found"), 400, None, None),
    (BundleError("chunk_2.mlpackage: missing"), 500, None, None),
    (PackageError("weight.bin: truncated"), 500, None, None),
    (BackendError("coremltools is not installed"), 500, None, None),
    (NonFiniteOutput("chunk_3: logits hold NaN or inf"), 500, None, None),
    (FunctionUnavailable("chunk_1: 'prefill_b8' cannot be loaded"), 500, None, None),
    (ExecutionError("op 'conv': unsupported pad"), 500, None, None),
    (ConfigError("config.json: hidden_size missing"), 500, None, None),
    (CheckpointError("model.safetensors: truncated"), 500, None, None),
    (ConvertError("--split 40: beyond the layers"), 500, None, None),
    (Cancelled("the client left"), 503, None, None),
]
IDS = [type(e).__name__ for e, *_ in SAMPLES]


@pytest.mark.parametrize("exc", [s[0] for s in SAMPLES], ids=IDS)
def test_the_cli_prints_any_of_them_as_one_line_with_its_exit_code(exc, monkeypatch, capsys):
    def fails(args):
        raise exc

    monkeypatch.setattr(cli.build, "cmd_plan", fails)
    rc = cli.main(["plan", "config.json"])
    out, err = capsys.readouterr()
    assert (rc, out, err) == (type(exc).exit_code, "", f"gemma-ane plan: error: {exc}\n")


@pytest.mark.parametrize("exc,status,param,code", SAMPLES, ids=IDS)
def test_the_server_maps_them_by_their_class(exc, status, param, code):
    from starlette.testclient import TestClient

    with TestClient(build_app(FakeModel([exc]), model_name="fake")) as http:
        r = http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
    err = assert_openai_error(r, status, param, code)
    if status < 500:
        assert err["message"] == str(exc) and err["type"] == "invalid_request_error"
    else:  # the message may name the server's files: it stays in the log
        assert str(exc) not in err["message"] and err["type"] == "server_error"


def test_an_api_error_keeps_its_own_status():
    """APIError is one of ours too (the CLI and a script catching GemmaAneError see it); its status is its own."""
    e = APIError(413, "too large", code="request_too_large")
    assert isinstance(e, GemmaAneError) and e.status == 413 and e.code == "request_too_large"
