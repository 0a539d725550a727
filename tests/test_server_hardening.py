"""Issue 25's hostile-client defects, server side: stop strings (bounded, and held back in linear time),
cancellation while a prompt is processed, the body limit of a vision bundle, and image errors that name
their part."""

from __future__ import annotations

import random
import time

import pytest
from scripted import scripted_model
from test_engine import recording_engine
from test_server import CHAT, THOUGHT, FakeModel, assert_openai_error

from gemma_ane.runtime.chat import MAX_STOP_CHARS, MAX_STOPS, OutputParser, StopError, check_stop
from gemma_ane.runtime.engine import Cancelled
from gemma_ane.server.app import Job, Worker, build_app

# -- stop strings ---------------------------------------------------------------------------------------------------


def test_stop_strings_are_bounded_in_count_and_length():
    assert check_stop(None) == [] and check_stop("x") == ["x"]
    assert check_stop(["a" * MAX_STOP_CHARS] * MAX_STOPS) == ["a" * MAX_STOP_CHARS] * MAX_STOPS
    with pytest.raises(StopError, match=f"stop: 5 strings, more than the {MAX_STOPS} allowed"):
        check_stop(list("abcde"))
    with pytest.raises(StopError, match=rf"^stop\[1\]: {MAX_STOP_CHARS + 1} characters, more than the limit"):
        check_stop(["ok", "a" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(StopError, match=r"^stop: expected a string or an array of strings"):
        check_stop([1])


def test_the_python_api_applies_the_same_bound():
    model = scripted_model()
    with pytest.raises(StopError, match=r"^stop: 1000001 characters"):
        model.generate("Hi", max_tokens=1, stop="x" * 1_000_001)
    with pytest.raises(StopError, match="5 strings"):
        list(model.stream_generate("Hi", max_tokens=1, stop=list("abcde")))


def test_the_server_refuses_an_unbounded_stop_before_it_queues():
    from starlette.testclient import TestClient

    model = FakeModel(THOUGHT)
    with TestClient(build_app(model, model_name="fake")) as http:
        for stop, where in [("x" * 100_000, "stop: "), (["a", "b" * 5000], "stop[1]: "), (list("abcde"), "stop: ")]:
            body = {"messages": [{"role": "user", "content": "hi"}], "stop": stop}
            assert assert_openai_error(http.post(CHAT, json=body), 400, "stop")["message"].startswith(where)
        ok = http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d"]})
    assert ok.status_code == 200 and len(model.calls) == 1


class CharTokenizer:
    """One token a character: the parser's Detokenizer needs decode() only."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def held_back_reference(text: str, stop: list[str]) -> list[str]:
    """The answer's releases, one character at a time, as the quadratic hold-back computed them."""
    pending, out = "", []
    for c in text:
        pending += c
        hit = [pending.find(s) for s in stop if s in pending]
        if hit:
            out.append(pending[: next(pending.find(s) for s in stop if s in pending)])
            return out
        hold = max((k for s in stop for k in range(1, len(s)) if pending.endswith(s[:k])), default=0)
        out.append(pending[: len(pending) - hold])
        pending = pending[len(out[-1]) :]
    return out


def test_the_hold_back_releases_what_the_reference_does():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 40)))
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        parser = OutputParser(CharTokenizer(), stop)
        got = [parser.add(ord(c)).content for c in text]
        want = held_back_reference(text, stop)
        assert got[: len(want)] == want, (text, stop)
        assert parser.stopped == (len(want) < len(text) or any(s in text for s in stop))


def _holding_cost(stop_length: int, tokens: int = 3000) -> float:
    """Seconds to parse `tokens` characters that each keep the whole answer a prefix of the stop string."""
    parser = OutputParser(CharTokenizer(), ["a" * (stop_length - 1) + "b"])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(tokens):
            parser.add(ord("a"))
        best = min(best, time.perf_counter() - t0)
    assert not parser.stopped and parser.text.startswith("a")
    return best


def test_the_hold_back_costs_the_same_whatever_the_stop_length():
    # quadratic, a 1000-character stop cost ~100x a 10-character one per token; linear, about the same
    short, long = _holding_cost(10), _holding_cost(MAX_STOP_CHARS)
    assert long < 10 * short, (short, long)


# -- cancellation before the first token -------------------------------------------------------------------------------


def test_a_cancelled_prompt_stops_between_prefill_batches_with_the_caches_in_step():
    engine, log = recording_engine(window=64, context=64, batch=8)
    asked = []

    def cancelled():
        asked.append(engine.position)
        return len(asked) > 2

    ids = list(range(1, 41))
    with pytest.raises(Cancelled):
        engine.prompt(ids, cancelled=cancelled)
    assert engine.position == 16 and engine.tokens == ids[:16]  # two batches ran; nothing half-written
    assert engine.prompt(ids)[0] == 16  # the next prompt reuses them


def test_the_runtime_asks_before_processing_the_prompt():
    model = scripted_model()
    with pytest.raises(Cancelled):
        list(model.stream_generate("Hi", max_tokens=1, cancelled=lambda: True))
    assert model.engine.position == 0  # the engine never ran


class SlowPrefill(FakeModel):
    """A prompt that takes as long as its client stays (checking as the runtime's prefill does), else 30 s."""

    def _run(self, prepared, cancelled):
        self.calls.append(prepared)
        if len(self.calls) == 1:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if cancelled is not None and cancelled():
                    raise Cancelled("cancelled")
                time.sleep(0.01)
        yield from self.script


def test_a_client_gone_during_its_prompt_frees_the_worker():
    import asyncio

    loop = asyncio.new_event_loop()
    model = SlowPrefill(THOUGHT)
    worker = Worker(model, max_queue=4)
    first, second = Job("first", [model.prepare("Hi")], loop), Job("second", [model.prepare("Hi")], loop)
    try:
        assert worker.submit(first) and worker.submit(second)
        time.sleep(0.2)
        t0 = time.monotonic()
        first.cancel()
        while worker.current is not None or worker.waiting:
            assert time.monotonic() - t0 < 5, "the worker is still busy with a cancelled prompt"
            time.sleep(0.01)
    finally:
        worker.stop()
        loop.close()
    assert len(worker.model.calls) == 2


# -- the body limit of a vision bundle -------------------------------------------------------------------------------


def test_a_vision_bundle_admits_image_bytes_not_text_bytes():
    from test_server_images import SMALL, ask, fake, image_url, png, serving, text

    long_text = "x" * 1_200_000  # over the text limit of 1 MB, far under a vision bundle's ~54 MB
    with serving(fake()) as http:
        r = http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "stop": long_text})
        err = assert_openai_error(r, 413, code="request_too_large")
        assert "besides its images, more than 1000000" in err["message"]
        assert_openai_error(ask(http, text(long_text), image_url(SMALL)), 413, code="request_too_large")
        assert ask(http, text("look"), image_url(png(1000, 1000))).status_code == 200  # 4 MB of image: fine


# -- image errors: named by their part -------------------------------------------------------------------------------


class Loader:
    """A vision model that only loads its images (as the bundle's encoder does first): the runtime's own errors."""

    kind = "image"

    def __init__(self, tokenizer):
        self.token_ids = tuple(tokenizer.token_to_id(t) for t in ("<|image>", "<|image|>", "<image|>"))

    def prepare(self, source, what):
        from gemma_ane.runtime.images import load_image

        load_image(source, what)
        raise AssertionError("the image was expected to fail")


def test_an_image_the_runtime_refuses_names_its_part():
    from starlette.testclient import TestClient
    from test_server_images import SMALL, image_url, text

    model = scripted_model()
    model.images = Loader(model.tokenizer)
    truncated = SMALL[: len(SMALL) // 2]  # the header intact: the server's check passes, decoding does not
    with TestClient(build_app(model, model_name="scripted")) as http:
        body = {"messages": [{"role": "user", "content": [text("look"), image_url(truncated)]}], "max_tokens": 1}
        err = assert_openai_error(http.post(CHAT, json=body), 400, "messages[0].content[1]")
    assert err["message"].startswith("messages[0].content[1]: truncated or corrupt")


@pytest.mark.parametrize(
    "messages, where, needle",
    [
        ([{"role": "system", "content": "IMAGE"}, {"role": "user", "content": "hi"}], "messages[0]", "leading system"),
        ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "IMAGE"}], "messages[1]", "tool message"),
    ],
)
def test_an_image_in_a_message_that_drops_it_is_refused(messages, where, needle):
    from test_server_images import SMALL, fake, image_url, serving, text

    for m in messages:
        if m["content"] == "IMAGE":
            m["content"] = [text("see"), image_url(SMALL)]
    model = fake()
    with serving(model) as http:
        err = assert_openai_error(http.post(CHAT, json={"messages": messages}), 400, f"{where}.content[1]")
    assert needle in err["message"] and "send images in user messages" in err["message"] and model.calls == []


def test_an_image_in_a_tool_result_is_taken():
    from test_server_images import SMALL, fake, image_url, serving

    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": call},
        {"role": "tool", "tool_call_id": "c1", "content": [image_url(SMALL)]},
    ]
    with serving(fake()) as http:
        assert http.post(CHAT, json={"messages": messages}).status_code == 200
