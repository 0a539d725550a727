"""The Swift package end to end on Linux: `gemma-ane-swift generate --json` runs a bundle through the Swift engine,
sampler, tokenizer and chat format, its chunks through the Python MIL executor over a pipe (gemma_ane.mil.serve), and
its token ids equal `gemma-ane generate --json`'s on the suite's bundles.

Both runs feed the MIL executor the same inputs (the host rows, masks and RoPE rows the Swift side builds are the
Python side's bit for bit: the Engine* Swift tests hold them to tests/swift_goldens_engine.py), so their logits are
the same numbers and greedy ids are compared exactly: the margin rules (tests/margins.py) are for two computations
of different precision, and here there is one. Seeded sampling draws from numpy's PCG64 stream in both: identical.

The package is built once per session (`swift build`); without a Swift toolchain these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SWIFT = shutil.which("swift") or next((p for p in ["/opt/swift/usr/bin/swift"] if Path(p).is_file()), None)
ASK = "What is the capital of France?"
PROMPT = "the cat sat on the mat and"

pytestmark = pytest.mark.skipif(SWIFT is None, reason="no Swift toolchain (swift) on PATH or in /opt/swift")


@pytest.fixture(scope="session")
def swift_exe() -> Path:
    """The package's executable, built once per session (its own build directory: the suite's runs may overlap)."""
    run = subprocess.run(
        [SWIFT, "build", "--product", "gemma-ane-swift"], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return ROOT / ".build" / "debug" / "gemma-ane-swift"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "GEMMA_ANE_PYTHON": sys.executable}


def swift_generate(exe: Path, bundle: Path, *args: str) -> dict:
    run = subprocess.run(
        [str(exe), "generate", str(bundle), *args, "--json"], capture_output=True, text=True, env=_env(), timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def python_generate(bundle: Path, *args: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "gemma_ane.cli", "generate", str(bundle), *args, "--json", "--backend", "mil"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def same_tokens(exe: Path, bundle: Path, *args: str) -> dict:
    """Both runtimes' results for the same arguments, their ids and text compared; the Swift one returned."""
    ours, theirs = swift_generate(exe, bundle, *args), python_generate(bundle, *args)
    assert ours["tokens"] == theirs["tokens"]
    assert ours["text"] == theirs["text"]
    return ours


@pytest.fixture(scope="session")
def four_chunks(tiny_e2b, tmp_path_factory) -> Path:
    """e2b-mini in four chunks (test_nchunks' split), 16 bits, a context of 128."""
    from conftest import _convert, built_once

    build = lambda d: _convert(tiny_e2b, d / "bundle", bits=16, split=(5, 9, 13))  # noqa: E731
    return built_once(tmp_path_factory, "swift_e2b4", build) / "bundle"


def test_the_demo_bundle_answers_paris(swift_exe, demo_bundle16):
    assert same_tokens(swift_exe, demo_bundle16, "--prompt", ASK, "--temperature", "0")["text"] == "Paris."


def test_the_demo_bundle_thinks_then_answers(swift_exe, demo_bundle16):
    """Thinking on: the thought channel comes back as reasoning, the answer as text."""
    args = ("--prompt", ASK, "--think", "--temperature", "0")
    ours, theirs = swift_generate(swift_exe, demo_bundle16, *args), python_generate(demo_bundle16, *args)
    assert ours["tokens"] == theirs["tokens"] and ours["text"] == theirs["text"]
    assert ours["reasoning"] == theirs["reasoning"] != ""


def test_a_second_turn_reuses_the_first(swift_exe, demo_bundle16):
    """`chat`: the second turn's answer is Python's, and only its new tokens are processed (as many reused as the
    Python runtime reuses for the same conversation)."""
    from gemma_ane import load

    turns = f"{ASK}\nAnd of Germany?\n"
    run = subprocess.run(
        [str(swift_exe), "chat", str(demo_bundle16), "--temperature", "0"],
        input=turns,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    model = load(demo_bundle16, backend="mil")
    first = model.generate(ASK, temperature=0)
    convo = [{"role": "user", "content": ASK}, {"role": "assistant", "content": first.text}]
    second = model.generate(messages=[*convo, {"role": "user", "content": "And of Germany?"}], temperature=0)
    assert run.stdout.splitlines() == [first.text, second.text]
    reused = [line.split("(")[1].split(" reused")[0] for line in run.stderr.splitlines() if " reused)" in line]
    assert reused == ["0", str(second.reused_tokens)] and second.reused_tokens > 0


@pytest.mark.slow  # four_chunks converts
def test_a_four_chunk_bundle(swift_exe, four_chunks):
    assert len(list(four_chunks.glob("chunk_*.mlpackage"))) == 4
    same_tokens(swift_exe, four_chunks, "--prompt", PROMPT, "--max-tokens", "24", "--temperature", "0")


def test_e4b_mini_with_a_system_turn(swift_exe, e4b_bundle16):
    args = ("--prompt", PROMPT, "--system", "Answer in one word.", "--max-tokens", "24", "--temperature", "0")
    same_tokens(swift_exe, e4b_bundle16, *args)


def test_a_prompt_past_the_sliding_window(swift_exe, tiny_bundle16):
    """e2b-mini's window is 16: a prompt of ~60 tokens wraps its rings several times, batched and single steps."""
    prompt = " ".join(f"word{i}" for i in range(20))
    result = same_tokens(
        swift_exe, tiny_bundle16, "--prompt", prompt, "--raw", "--max-tokens", "40", "--temperature", "0"
    )
    assert result["prompt_tokens"] > 3 * 16


def test_seeded_sampling_at_temperature_1_with_top_p(swift_exe, tiny_bundle16):
    # raw: through the chat format this random model's next token is all but certain, whatever the seed
    args = ("--prompt", PROMPT, "--raw", "--max-tokens", "32", "--temperature", "1", "--top-p", "0.9")
    first = same_tokens(swift_exe, tiny_bundle16, *args, "--seed", "7")
    second = same_tokens(swift_exe, tiny_bundle16, *args, "--seed", "8")
    assert first["tokens"] != second["tokens"]  # the seed reaches the draws


def test_bad_input_is_one_line(swift_exe, tmp_path, tiny_bundle16):
    """A missing bundle, a damaged model_config.json, an option out of range: one line naming it, exit 2."""
    damaged = tmp_path / "bundle"
    shutil.copytree(tiny_bundle16, damaged)
    config = json.loads((damaged / "model_config.json").read_text())
    (damaged / "model_config.json").write_text(json.dumps({**config, "sliding_window": 0}))
    cases = [
        (tmp_path / "none", [], "not a bundle directory"),
        (damaged, [], "model_config.json: sliding_window=0: expected a positive integer"),
        (tiny_bundle16, ["--top-p", "1.5"], "--top-p=1.5: must be <= 1.0"),
    ]
    for bundle, args, needle in cases:
        run = subprocess.run(
            [str(swift_exe), "generate", str(bundle), "--prompt", "hi", "--raw", *args],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=600,
        )
        assert run.returncode == 2 and needle in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def _frame(header: dict, payload: bytes = b"") -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<I", len(body)) + body + payload


def test_the_pipe_server_answers_errors_and_stops_on_bad_frames(tiny_bundle16):
    """gemma_ane.mil.serve: a request it cannot honour is an error reply and the server goes on; a frame it cannot
    read (a header past its bound, a tensor the function does not declare) ends it with one line and exit 1.
    Runs without Swift."""
    from gemma_ane.mil.serve import MAX_HEADER

    def serve(data: bytes) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "gemma_ane.mil.serve",
                *(str(tiny_bundle16 / f"chunk_{i}.mlpackage") for i in (1, 2, 3)),
            ],
            input=data,
            capture_output=True,
            env=_env(),
            timeout=600,
        )

    run = serve(_frame({"op": "load", "chunk": "chunk_9", "function": "infer"}) + _frame({"op": "hello"}))
    assert run.returncode == 0, run.stderr
    (size,) = struct.unpack("<I", run.stdout[:4])
    first = json.loads(run.stdout[4 : 4 + size])
    assert first == {"error": "no chunk 'chunk_9' (has chunk_1, chunk_2, chunk_3)", "kind": "bundle"}
    hello = json.loads(run.stdout[8 + size :])
    assert [c["name"] for c in hello["chunks"]] == ["chunk_1", "chunk_2", "chunk_3"]
    assert hello["chunks"][0]["functions"][0] == "infer"
    bad = [
        (struct.pack("<I", MAX_HEADER + 1), f"a header of {MAX_HEADER + 1} bytes"),
        (_frame({"op": "predict", "chunk": "chunk_1", "function": "infer", "tensors": [{"name": "x"}]}), "tensor 'x'"),
        (_frame({"op": "hello"})[:6], "the stream ended inside a frame"),
    ]
    for data, needle in bad:
        run = serve(data)
        err = run.stderr.decode().strip().splitlines()
        assert run.returncode == 1 and len(err) == 1 and needle in err[0], run.stderr


# -- a context ladder (CONTRACT §3a): e2b-mini (window 16) on rungs 32 / 64 / 128 ------------------------------------


@pytest.fixture(scope="session")
def ladder_bundle(tiny_e2b, tmp_path_factory) -> Path:
    from conftest import _convert, built_once

    build = lambda d: _convert(tiny_e2b, d / "bundle", bits=16, contexts=(32, 64, 128))  # noqa: E731
    return built_once(tmp_path_factory, "swift_ladder", build) / "bundle"


def climbs(result: dict) -> list[str]:
    """Where a generation climbed (its crossings without their timings)."""
    return [c.split(" (")[0] for c in result["crossings"]]


@pytest.mark.slow  # ladder_bundle converts
def test_a_ladder_answer_climbs_two_rungs_as_python_does(swift_exe, ladder_bundle):
    """Starts on rung 32 (the prompt fits), climbs to 64 then 128 mid-answer, carrying the caches: the tokens are the
    Python engine's, and so are the climbing decisions (rung and position of each crossing)."""
    args = ("--prompt", PROMPT, "--raw", "--max-tokens", "90", "--temperature", "0")
    ours, theirs = swift_generate(swift_exe, ladder_bundle, *args), python_generate(ladder_bundle, *args)
    assert ours["prompt_tokens"] < 32 and ours["generated_tokens"] == 90
    assert climbs(ours) == climbs(theirs) == ["context 32 -> 64 at position 32", "context 64 -> 128 at position 64"]
    assert ours["tokens"] == theirs["tokens"] and ours["text"] == theirs["text"]


@pytest.mark.slow  # ladder_bundle converts
def test_a_ladder_second_turn_after_a_crossing(swift_exe, ladder_bundle):
    """`chat`: the first answer climbs past rung 32; the second turn reuses a prefix of the first on the rung reached
    and climbs again: both answers, the tokens reused and the climbs are the Python runtime's."""
    from gemma_ane import load

    # the penalty keeps this random model from answering one token over and over
    penalty, kw = ("--repetition-penalty", "1.5"), dict(temperature=0, max_tokens=30, repetition_penalty=1.5)
    run = subprocess.run(
        [str(swift_exe), "chat", str(ladder_bundle), "--temperature", "0", "--max-tokens", "30", *penalty],
        input=f"{PROMPT}\nAnd then?\n",
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    model = load(ladder_bundle, backend="mil")
    first = model.generate(PROMPT, **kw)
    convo = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.text}]
    second = model.generate(messages=[*convo, {"role": "user", "content": "And then?"}], **kw)
    assert first.crossings and second.crossings and model.engine.rung == 128
    assert run.stdout == f"{first.text}\n{second.text}\n"
    stats = [line for line in run.stderr.splitlines() if " reused)" in line]
    reused = [line.split("(")[1].split(" reused")[0] for line in stats]
    # the chat format renders an answer anew, so the second turn reuses the prefix up to it, kept on the rung reached
    assert reused == ["0", str(second.reused_tokens)] and second.reused_tokens > 0
    climbed = [[c.split(" (")[0] for c in line.split(" | climbed: ")[1:]] for line in stats]
    assert climbed == [[c.split(" (")[0] for c in r.crossings] for r in (first, second)]
