"""One error hierarchy (gemma_ane/errors.py): every exception class the package defines derives from
GemmaAneError, and its class alone says how it is reported: the CLI prints one line and exits with
`exit_code`, the server answers with `status`, `code` and `param`."""

from __future__ import annotations

import ast
import builtins
import importlib
import io
import tokenize
from types import SimpleNamespace

import numpy as np
import pytest
from test_server import CHAT, FakeModel, assert_openai_error
from test_walls import PACKAGE, modules

from gemma_ane import cli, errors
from gemma_ane.bundle import BundleError
from gemma_ane.bundle.spec import ConfigError
from gemma_ane.convert.checkpoint import CheckpointError
from gemma_ane.convert.options import ConvertError
from gemma_ane.errors import ConversionError, DeviceError, GemmaAneError, InputError
from gemma_ane.files import FileFormatError
from gemma_ane.mil.executor import ExecutionError
from gemma_ane.mil.package import PackageError
from gemma_ane.runtime.chat import ChatError, InvalidText, StopError, TooDeep
from gemma_ane.runtime.device import BackendError
from gemma_ane.runtime.engine import Cancelled, ContextOverflow, Engine, FunctionUnavailable, NonFiniteOutput
from gemma_ane.runtime.grammar import GrammarError
from gemma_ane.runtime.images import ImageError
from gemma_ane.runtime.prompt_cache import PromptCacheError
from gemma_ane.runtime.sampling import Proposal, SamplingError
from gemma_ane.runtime.tools import MAX_DEPTH, ToolError, parse_call
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


# -- no builtin exception raised where a user can meet it ------------------------------------------------------------

INTERNAL = "# internal:"  # the mark of a raise that no user input reaches, with why


def builtin_raises(source: str) -> list[tuple[int, str]]:
    """(line, class) of each `raise` of a builtin exception class in `source` that no `# internal:` comment marks,
    on one of its own lines or alone on the line above it."""
    own, above = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.string.startswith(INTERNAL):
            own.add(tok.start[0])
            if tok.line.lstrip().startswith("#"):
                above.add(tok.start[0] + 1)
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        name = ast.unparse(target).removeprefix("builtins.")
        cls = getattr(builtins, name, None)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            continue
        if node.lineno not in above and not own & set(range(node.lineno, node.end_lineno + 1)):
            found.append((node.lineno, name))
    return sorted(found)


def test_the_walk_finds_an_unmarked_builtin_raise():
    source = """
def f(x):
    if x:
        raise ValueError(f"x={x}")  # a message is no mark
    # internal: the caller checked y
    raise KeyError(
        "y"  # internal: or here
    )

def g(y):
    raise builtins.TypeError  # written through the module
    raise InputError("fine")
    raise RuntimeError("z")  # internal: on its own line
    y = 1  # internal: a comment on the statement above marks that one only
    raise RuntimeError
"""
    assert builtin_raises(source) == [(4, "ValueError"), (11, "TypeError"), (15, "RuntimeError")]


def test_no_builtin_exception_is_raised_unless_marked_internal():
    """Every error a user can meet is a GemmaAneError; a builtin one is raised only where no user input reaches,
    and a `# internal: why` comment says so. The rule holds for code written later."""
    unmarked, marked = [], 0
    for path in modules().values():
        source = path.read_text()
        unmarked += [f"gemma_ane/{path.relative_to(PACKAGE)}:{line}: {cls}" for line, cls in builtin_raises(source)]
        marked += source.count(INTERNAL)
    assert marked >= 5  # the walk does read the package: the engine's, the chat parser's, the prompt cache's
    assert not unmarked, "raise a package error (gemma_ane.errors) naming the problem, or mark it internal:\n" + (
        "\n".join(unmarked)
    )


# -- a sample of what used to be builtin errors, at the entry points a user meets them --------------------------------


BUILD_PARSER = cli.build_parser  # cli_run replaces cli's for one run


def cli_run(argv: list[str], monkeypatch, capsys) -> tuple[int, str, BaseException | None]:
    """`gemma-ane ARGV`: its exit code, its stderr, and the exception its command raised (main prints it)."""
    parser = BUILD_PARSER()
    args = parser.parse_args(argv)
    command, raised = args.fn, []

    def recording(a):
        try:
            return command(a)
        except BaseException as e:
            raised.append(e)
            raise

    args.fn = recording
    fake = SimpleNamespace(parse_args=lambda _: args, _actions=parser._actions)  # the flags main names in errors
    monkeypatch.setattr(cli, "build_parser", lambda: fake)
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert out == ""
    return rc, err, raised[0] if raised else None


def test_convert_with_draft_tokens_and_no_assistant(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bundle"
    rc, err, e = cli_run(["convert", str(tmp_path / "ckpt"), str(out), "--draft-tokens", "3"], monkeypatch, capsys)
    assert (rc, err) == (
        2,
        "gemma-ane convert: error: --draft-tokens: needs --assistant (the drafter whose tokens "
        "the verify calls check)\n",
    )
    assert isinstance(e, ConversionError) and not out.exists()


def test_generate_with_an_image_and_raw(tmp_path, monkeypatch, capsys):
    argv = ["generate", str(tmp_path / "bundle"), "-p", "hi", "--image", "a.png", "--raw"]
    rc, err, e = cli_run(argv, monkeypatch, capsys)
    assert rc == 2 and err.startswith("gemma-ane generate: error: --image: a raw prompt has no chat template")
    assert err.count("\n") == 1 and isinstance(e, InputError)


def test_generate_with_a_json_schema_file_that_is_not_json(tmp_path, monkeypatch, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object",')
    rc, err, e = cli_run(
        ["generate", str(tmp_path / "bundle"), "-p", "hi", "--json-schema", str(schema)], monkeypatch, capsys
    )
    assert (rc, err) == (
        2,
        f"gemma-ane generate: error: {schema}: not JSON (Expecting property name enclosed in "
        "double quotes at line 1, column 19)\n",
    )
    assert isinstance(e, InputError)


def test_tiny_over_an_existing_directory(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    rc, err, e = cli_run(["tiny", str(out)], monkeypatch, capsys)
    assert (rc, err) == (2, f"gemma-ane tiny: error: {out}: already exists (use --force to replace it)\n")
    assert isinstance(e, InputError) and [p.name for p in out.iterdir()] == ["mine.txt"]
    from gemma_ane.oracle.tiny import write_tiny  # the CLI's --preset lists its choices (argparse refuses others)

    with pytest.raises(InputError, match="^--preset 'e9b': choose one of e2b-mini"):
        write_tiny(tmp_path / "new", preset="e9b")
    assert not (tmp_path / "new").exists()


def test_server_options_out_of_range():
    with pytest.raises(InputError, match=r"^max_images=-1: must be >= 0$"):
        build_app(FakeModel([]), model_name="fake", max_images=-1)
    with pytest.raises(InputError, match=r"^max_queue=-1: must be >= 0$"):
        build_app(FakeModel([]), model_name="fake", max_queue=-1)
    with pytest.raises(InputError, match=r"^allow_fetch_from: 'a b': expected an address"):
        build_app(FakeModel([]), model_name="fake", allow_fetch_from=["a b"])


def test_a_bundle_whose_chunks_are_out_of_order():
    """A bundle's fault, not the request's: the server answers 500 and keeps the message in its log."""

    def chunk(name, states):
        return SimpleNamespace(name=name, interfaces={"infer": {"inputs": {}, "outputs": {}, "states": states}})

    chunks = [chunk("chunk_1", {"kv": {}}), chunk("chunk_3", {}), chunk("chunk_2", {"kv": {}})]
    with pytest.raises(errors.BundleError, match="^chunks chunk_1, chunk_3, chunk_2: the stateful chunks must come"):
        Engine(chunks, None, context=64, window=16, prefill_batch=8)


def test_a_drafter_whose_logits_do_not_cover_the_vocabulary():
    with pytest.raises(errors.BundleError, match=r"^the drafter's proposal: 5 ids, 5 logits, fill None, for a voc"):
        Proposal(np.arange(5), np.zeros(5), None, 8)


def test_quantizing_a_weight_with_non_finite_values():
    from gemma_ane.convert.blockquant import quantize_blockwise
    from gemma_ane.convert.palettize import kmeans_lut

    weight = np.ones((32, 64), np.float32)
    weight[3, 5] = np.inf
    with pytest.raises(ConversionError, match="non-finite"):
        quantize_blockwise(weight)
    with pytest.raises(ConversionError, match="non-finite"):
        kmeans_lut(weight)
    with pytest.raises(ConversionError, match=r"^nbits=6: choose 4 or 8$"):
        quantize_blockwise(np.ones((32, 64)), nbits=6)


def test_verify_with_an_unknown_precision(tmp_path):
    from gemma_ane.oracle.verify import verify_bundle, verify_graph

    with pytest.raises(InputError, match=r"^--precision 'fp8': choose fp32 or fp16$"):
        verify_graph(tmp_path, precision="fp8")
    with pytest.raises(InputError, match=r"^--image and --audio: verify one kind of media a run$"):
        verify_bundle(tmp_path, tmp_path, images=["a.png"], audio=["a.wav"])


def test_a_tool_call_the_model_wrote_badly():
    with pytest.raises(InputError, match=r"^expected ':' at character 10, found '}'$"):
        parse_call("call:f{key}")


def test_the_runtime_refuses_bad_arguments_as_input_errors(tiny_bundle16, tmp_path):
    from gemma_ane import load

    model = load(tiny_bundle16, backend="mil")
    with pytest.raises(InputError, match=r"^max_tokens=-1: expected a non-negative integer$"):
        model.generate("Hi", raw=True, max_tokens=-1)
    with pytest.raises(InputError, match=r"^draft_tokens=2: this bundle has no drafter \(convert with --assistant\)$"):
        model.generate("Hi", raw=True, max_tokens=2, draft_tokens=2)
    with pytest.raises(InputError, match=r"^give a prompt or messages$"):
        model.generate(raw=True)
    model.generate("Hi", raw=True, max_tokens=2)
    with pytest.raises(InputError, match=r"^no caches of exactly 1 tokens here"):
        model.save_prompt_cache(tmp_path / "x.npz", 1)
    assert not (tmp_path / "x.npz").exists()


def test_a_runtime_error_found_before_the_queue_keeps_its_param():
    """The same TooDeep, found by prepare or by the generation, gives the same response (one mapping)."""
    from starlette.testclient import TestClient

    nested = []
    for _ in range(MAX_DEPTH + 1):
        nested = [nested]
    deep = {"role": "user", "content": [{"type": "text", "text": "hi", "x": nested}]}
    with TestClient(build_app(FakeModel([]), model_name="fake")) as http:
        r = http.post(CHAT, json={"messages": [deep]})
    assert_openai_error(r, 400, "messages[0].content", None)


def test_python_m_gemma_ane_server_prints_any_package_error_as_one_line(monkeypatch, capsys):
    from gemma_ane.server import app as server

    e = FunctionUnavailable("chunk_1: function 'infer' cannot be loaded on cpu_and_ne")  # not a ValueError

    def fails(a):
        raise e

    monkeypatch.setattr(server, "_cmd_serve", fails)
    assert server.main(["bundle"]) == FunctionUnavailable.exit_code
    assert capsys.readouterr().err == f"gemma-ane serve: error: {e}\n"


def test_an_api_keyword_reads_as_the_flag_typed():
    """The CLI's and the server's one-line errors name the flag where the Python API names its keyword."""
    from gemma_ane.errors import as_typed

    flags = {"--draft", "--max-tokens"}
    assert as_typed("draft_tokens=4: at most 3", flags) == "--draft 4: at most 3"
    assert as_typed("max_tokens=-1: must be positive", flags) == "--max-tokens -1: must be positive"
    assert as_typed("top_k=0: must be positive", flags) == "top_k=0: must be positive"  # the command has no --top-k
    assert as_typed("bundle/x.bin: a=b", flags) == "bundle/x.bin: a=b"
    assert as_typed("max_tokens: 5: too many", flags) == "--max-tokens: 5: too many"  # a keyword, then its part
    assert as_typed("chunk_1: no function", flags) == "chunk_1: no function"  # no such flag: not a keyword
