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
