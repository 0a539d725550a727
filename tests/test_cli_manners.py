"""The CLI's manners (issue 47): standard input as a prompt, `tokenize`, logprobs a person can read, a checkpoint
named as such, `python -m gemma_ane`."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from gemma_ane.bundle import layout
from gemma_ane.cli import main


@pytest.fixture(scope="module")
def tokenizer(tiny_bundle16):
    return Tokenizer.from_file(str(tiny_bundle16 / layout.HF_TOKENIZER))


def _stdin(monkeypatch, text: str):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8"))


def test_tokenize_gives_ids_and_pieces_and_back(capsys, monkeypatch, tiny_bundle16, tokenizer):
    text = "Hello wörld 🎉 ok"
    assert main(["tokenize", str(tiny_bundle16), text, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ids"] == tokenizer.encode(text, add_special_tokens=False).ids
    assert b"".join(p.encode() if not p.startswith("<0x") else bytes.fromhex(p[3:5]) for p in got["pieces"]) == (
        text.encode()
    )  # a piece of a character shows its byte
    _stdin(monkeypatch, text + "\n")  # from standard input, echo's newline dropped
    assert main(["tokenize", str(tiny_bundle16)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == " ".join(map(str, got["ids"])) and len(lines) == 1 + len(got["ids"])
    assert main(["tokenize", str(tiny_bundle16), "--decode", ",".join(map(str, got["ids"]))]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_tokenize_refuses_an_id_past_the_vocabulary(capsys, tiny_bundle16, tokenizer):
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    assert main(["tokenize", str(tiny_bundle16), "--decode", f"2 {n}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gemma-ane tokenize: error: --decode: token id {n} is past the vocabulary ({n} tokens)"
    )


def test_generate_reads_its_prompt_from_standard_input(capsys, monkeypatch, tiny_bundle16):
    args = ["generate", str(tiny_bundle16), "--backend", "mil", "--max-tokens", "2", "--temperature", "0", "--json"]
    assert main([*args, "-p", "Tell me a story."]) == 0
    given = json.loads(capsys.readouterr().out)
    _stdin(monkeypatch, "Tell me a story.\n")
    assert main([*args, "-p", "-"]) == 0
    read = json.loads(capsys.readouterr().out)
    assert read["prompt_tokens"] == given["prompt_tokens"] and read["tokens"] == given["tokens"]


def test_logprobs_are_text_without_json_and_beside_the_ids_with_it(capsys, tiny_bundle16, tokenizer):
    args = ["generate", str(tiny_bundle16), "-p", "Hi", "--backend", "mil", "--max-tokens", "3", "--temperature", "0"]
    assert main([*args, "--logprobs", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in got["tokens"]]
    assert got["token_text"] == pieces
    assert [[row[0][0], row[0][1]] for row in got["top_logprobs"]] == [[t, p] for t, p in zip(got["tokens"], pieces)]
    assert main([*args, "--logprobs", "2"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("logprobs (token, logprob | alternatives):") :].splitlines()[1:]
    assert len(table) == 3
    for line, token, piece, lp in zip(table, got["tokens"], pieces, got["logprobs"]):
        assert line.split()[0] == json.dumps(piece).split()[0] and f"{lp:8.3f}".strip() in line, (line, token)
        assert line.count('"') >= 6  # the token and its two alternatives, each quoted


def test_a_checkpoint_where_a_bundle_is_meant_is_named(capsys, tiny_e2b):
    for command in (["check"], ["inspect"], ["generate", "-p", "hi"], ["tokenize"]):
        argv = [command[0], str(tiny_e2b), *command[1:]]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.strip().endswith(
            f"{tiny_e2b}: a Hugging Face checkpoint, not a bundle: run `gemma-ane convert {tiny_e2b} OUT` first"
        ), err


def test_python_dash_m_gemma_ane_is_the_command():
    r = subprocess.run([sys.executable, "-m", "gemma_ane", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("gemma-ane "), r.stderr


def test_the_library_keeps_quiet_and_the_command_says_its_backend(capfd, caplog, tiny_bundle16):
    import logging

    import gemma_ane

    assert "logging" not in vars(gemma_ane)
    with caplog.at_level(logging.INFO, logger="gemma_ane"):
        gemma_ane.load(tiny_bundle16)  # backend "auto"
    assert capfd.readouterr() == ("", "")  # nothing printed
    assert [r.getMessage() for r in caplog.records] == ["backend: mil (MIL executor)"]  # logged instead
    assert main(["tokenize", str(tiny_bundle16), "x"]) == 0  # a command that loads no model says nothing of one
    assert main(["generate", str(tiny_bundle16), "-p", "hi", "--max-tokens", "1"]) == 0
    assert "backend: mil (MIL executor)\n" in capfd.readouterr().err
