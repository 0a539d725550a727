"""`gemma-ane chat` past the context: the oldest turns give way, the conversation goes on (issue 18)."""

from __future__ import annotations

import io
import sys

import pytest

import gemma_ane
from gemma_ane.cli import main

CONTEXT = 128  # the shared tiny bundle's


@pytest.fixture(scope="module")
def model(tiny_bundle16):
    m = gemma_ane.load(tiny_bundle16, backend="mil")
    assert m.context == CONTEXT
    return m


@pytest.fixture
def chat(model, tiny_bundle16, monkeypatch, capsys):
    """Run `gemma-ane chat` in-process on `script` (the already-loaded model stands in for load);
    returns (rc, stdout, stderr, the conversation of every answered turn)."""
    turns = []
    original = model.stream_generate

    def recording(prompt=None, messages=None, **kw):
        for ev in original(prompt, messages, **kw):
            yield ev
        turns.append({"messages": [dict(m) for m in messages], "prompt_tokens": ev.prompt_tokens})

    monkeypatch.setattr(gemma_ane, "load", lambda bundle, **kw: model)
    monkeypatch.setattr(model, "stream_generate", recording)
    model.reset()

    def run(script: str, *flags):
        monkeypatch.setattr(sys, "stdin", io.StringIO(script))
        rc = main(["chat", str(tiny_bundle16), "--backend", "mil", "--temperature", "0", *flags])
        out, err = capsys.readouterr()
        return rc, out, err, turns

    return run


def test_chat_outlives_its_context(chat):
    lines = [f"Tell me about item {i}." for i in range(30)]
    rc, out, err, turns = chat("\n".join(lines) + "\n", "--max-tokens", "4", "--system", "Be brief.")
    assert rc == 0, err
    # every line was answered, each with the system turn first and its own line last
    assert [t["messages"][-1]["content"] for t in turns] == lines
    assert all(t["messages"][0] == {"role": "system", "content": "Be brief."} for t in turns)
    assert all(t["prompt_tokens"] + 4 <= CONTEXT for t in turns)
    # the oldest exchanges went, with a note each time; no more than needed
    notes = [line for line in err.splitlines() if line.startswith("(dropped the ")]
    assert notes and all(n.endswith(f"oldest turns to fit the context of {CONTEXT})") for n in notes), err
    assert max(len(t["messages"]) for t in turns[len(turns) // 2 :]) > 3
    for before, after in zip(turns, turns[1:]):  # what stays is the newest part of what was
        kept = after["messages"][1:-2]  # between the system turn and the last answer
        assert kept == before["messages"][len(before["messages"]) - len(kept) :]


def test_a_message_longer_than_the_context_is_refused_and_the_chat_goes_on(chat):
    long = " ".join(["word"] * 200)
    rc, out, err, turns = chat(f"Hello.\n{long}\nAnd now?\n", "--max-tokens", "4")
    assert rc == 0, err
    assert "(not sent: this message needs " in err and f"the context of {CONTEXT}" in err, err
    assert [t["messages"][-1]["content"] for t in turns] == ["Hello.", "And now?"]
    assert [m["role"] for m in turns[1]["messages"]] == ["user", "assistant", "user"]  # the conversation kept


def test_a_line_that_is_not_text_is_refused_and_the_chat_goes_on(chat):
    rc, out, err, turns = chat("Hello\nbad \udcff byte\nGoodbye\n", "--max-tokens", "3")
    assert rc == 0, err
    assert [t["messages"][-1]["content"] for t in turns] == ["Hello", "Goodbye"]
    assert "gemma-ane chat: error: " in err and "not valid text" in err and "lone surrogate" in err
    assert [m["content"] for m in turns[-1]["messages"] if m["role"] == "user"] == ["Hello", "Goodbye"]


def test_commands_are_answered_and_never_sent(chat):
    rc, out, err, turns = chat("/help\n/bogus now\n//etc is a folder\n/quit\nnever sent\n", "--max-tokens", "2")
    assert rc == 0, err
    assert [t["messages"][-1]["content"] for t in turns] == ["/etc is a folder"]  # `//` sends one slash
    assert err.startswith("gemma-ane chat: type a message; /help, /quit, /exit")  # the banner lists the commands
    assert "unknown command /bogus (not sent to the model); commands:" in err
    assert err.count("  /think on|off") == 2 and "  /exit" in err  # /help's list, and the unknown command's


def test_exit_leaves(chat):
    rc, out, err, turns = chat("Hello\n/exit\nnever sent\n", "--max-tokens", "2")
    assert rc == 0 and [t["messages"][-1]["content"] for t in turns] == ["Hello"]


@pytest.mark.slow
def test_a_long_chat_on_the_demo_reuses_the_cache(demo_bundle16, monkeypatch, capsys):
    """The demo's defaults (context 512, max tokens 256) over 30 turns: a cut keeps about half of what the answer
    leaves, so most turns grow on the cached prompt (a cut on every turn once full reprocessed every prompt)."""
    from gemma_ane.oracle.demo_corpus import CAPITALS

    model = gemma_ane.load(demo_bundle16, backend="mil")
    reused, original = [], model.stream_generate

    def recording(prompt=None, messages=None, **kw):
        for ev in original(prompt, messages, **kw):
            yield ev
        reused.append(ev.reused_tokens / ev.prompt_tokens)

    monkeypatch.setattr(gemma_ane, "load", lambda bundle, **kw: model)
    monkeypatch.setattr(model, "stream_generate", recording)
    questions = [f"What is the capital of {c}?" for c in CAPITALS] * 30
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(questions[:30]) + "\n"))
    assert main(["chat", str(demo_bundle16), "--backend", "mil", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert len(reused) == 30 and "(dropped the " in err  # the context did fill
    assert sum(r > 0.5 for r in reused) >= 24, reused
