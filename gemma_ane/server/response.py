"""The server's responses: the runtime's events rendered as OpenAI's objects, whole or as a stream of chunks
(Render), and the ASGI response that waits on a queued job and sends them (Generation)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time

from ..runtime.tokens import TokenBytes
from .request import APIError, Request, error_of
from .worker import END, Job


class Vocab:
    """Each token's own string and bytes, as OpenAI's logprobs report them. A token that is part of a
    multi-byte character decodes to U+FFFD on its own, so its bytes come from its piece (tokens.TokenBytes)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes = TokenBytes(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self._cache:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            raw = text.encode("utf-8")
            if "\ufffd" in text:
                raw = self._bytes(token) or raw
            self._cache[token] = (text, list(raw))
        return self._cache[token]


def _lp(x: float) -> float:
    # JSON has no -inf; OpenAI reports "never" as -9999
    return x if math.isfinite(x) else -9999.0


class Render:
    """Turns the runtime's events into OpenAI response objects: whole, or as stream chunks."""

    def __init__(self, req: Request, rid: str, model_name: str, vocab: Vocab):
        self.req, self.id, self.model, self.vocab = req, rid, model_name, vocab
        self.chat = req.kind == "chat"
        self.created = int(time.time())
        self.completion_tokens = 0
        self.prompt_tokens = req.prompt_tokens  # prepare's; the last event's replaces it (see _ended)
        self.cached_tokens = 0  # prompt tokens the model's caches already held (the last event says)
        self.offset = 0  # legacy logprobs' text_offset
        self.calls = 0  # tool calls streamed so far: the next one's index

    def _envelope(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _ended(self, ev) -> None:
        """Takes the prompt's counts from the generation's last event. Its prompt_tokens is the runtime's, with
        each image's soft tokens (prepare saw one placeholder an image); a model reporting 0 keeps ours."""
        self.prompt_tokens = ev.prompt_tokens or self.prompt_tokens
        self.cached_tokens = ev.reused_tokens

    def usage(self) -> dict:
        p, c = self.prompt_tokens, self.completion_tokens
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _logprobs(self, events) -> dict | None:
        """The logprobs object for these events' tokens, in the endpoint's format."""
        events = [ev for ev in events if ev.token is not None]
        if self.req.logprobs is None:
            return None
        if self.chat:

            def entry(token, lp):
                text, raw = self.vocab(token)
                return {"token": text, "logprob": _lp(lp), "bytes": raw}

            return {
                "content": [
                    {**entry(ev.token, ev.logprob), "top_logprobs": [entry(t, lp) for t, lp in ev.top_logprobs]}
                    for ev in events
                ]
            }
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for ev in events:
            text = self.vocab(ev.token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(_lp(ev.logprob))
            out["top_logprobs"].append({self.vocab(t)[0]: _lp(lp) for t, lp in ev.top_logprobs})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def whole(self, events: list) -> dict:
        self.completion_tokens = sum(ev.token is not None for ev in events)
        self._ended(events[-1])  # Generation renders only a generation that finished
        text = "".join(ev.text for ev in events)
        finish = next((ev.finish_reason for ev in events if ev.finish_reason), None)
        if self.chat:
            calls = [call.to_openai() for ev in events for call in ev.tool_calls]
            message = {"role": "assistant", "content": None if calls and not text else text}
            if calls:
                message["tool_calls"] = calls
            reasoning = "".join(ev.reasoning for ev in events)
            if reasoning:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": self._logprobs(events), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(events), "finish_reason": finish}
        return {**self._envelope(False), "choices": [choice], "usage": self.usage()}

    def _chunk(self, choice: dict) -> dict:
        out = {**self._envelope(True), "choices": [{"index": 0, **choice}]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def _call_deltas(self, call) -> list[dict]:
        """A call as OpenAI streams one: its id and name, then its arguments in fragments. The runtime has the
        call whole when it closes; a few fragments keep clients honest that must concatenate them."""
        index, f = self.calls, call.to_openai()
        self.calls += 1
        arguments = f["function"]["arguments"]
        head = {"index": index, "id": f["id"], "type": "function", "function": {"name": call.name, "arguments": ""}}
        size = max(1, -(-len(arguments) // 3))
        parts = [arguments[i : i + size] for i in range(0, len(arguments), size)]
        return [{"tool_calls": [head]}] + [
            {"tool_calls": [{"index": index, "function": {"arguments": p}}]} for p in parts
        ]

    def start(self) -> list[dict]:
        return (
            [self._chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})]
            if self.chat
            else []
        )

    def step(self, ev) -> list[dict]:
        """The chunks for one event: its text and reasoning (and token logprobs), then, on the
        last event, the finish reason and (if asked for) the usage."""
        self.completion_tokens += ev.token is not None
        out = []
        lp = self._logprobs([ev]) if ev.token is not None else None
        if self.chat:
            delta = {}
            if ev.reasoning:
                delta["reasoning_content"] = ev.reasoning
            if ev.text:
                delta["content"] = ev.text
            deltas = ([delta] if delta else []) + [d for call in ev.tool_calls for d in self._call_deltas(call)]
            for i, d in enumerate(deltas or ([{}] if lp else [])):  # the token's logprobs go with its first delta
                out.append(self._chunk({"delta": d, "logprobs": lp if i == 0 else None, "finish_reason": None}))
        elif ev.text or lp:
            out.append(self._chunk({"text": ev.text, "logprobs": lp, "finish_reason": None}))
        if ev.finish_reason:
            self._ended(ev)
            end = {"delta": {}} if self.chat else {"text": ""}
            out.append(self._chunk({**end, "logprobs": None, "finish_reason": ev.finish_reason}))
            if self.req.include_usage:
                out.append({**self._envelope(True), "choices": [], "usage": self.usage()})
        return out


async def _send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class Generation:
    """The ASGI response for one queued job. It waits for the job's first event before choosing a
    status, so a request the runtime refuses still gets a plain 400; it watches the connection
    the whole time and cancels the job when the client goes (the worker stops at its next
    token, or skips the job if it has not started)."""

    def __init__(self, job: Job, render: Render):
        self.job, self.render = job, render

    async def __call__(self, scope, receive, send) -> None:
        job = self.job

        async def watch():
            with contextlib.suppress(Exception):  # a receive that fails means the client is gone too
                while (await receive())["type"] != "http.disconnect":
                    pass
            job.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            first = await job.next()
            if first is END:
                err = APIError(503, "the server is shutting down", type="server_error")
                await _send_json(send, err.status, err.body())
            elif isinstance(first, BaseException):
                err = error_of(first)
                await _send_json(send, err.status, err.body())
            elif self.render.req.stream:
                await self._stream(first, send)
            else:
                await self._whole(first, send)
        except OSError:  # ASGI 2.4 servers raise on send once the client is gone
            pass
        finally:
            job.cancel()
            watcher.cancel()

    async def _whole(self, item, send) -> None:
        events = []
        while item is not END:
            if isinstance(item, BaseException):
                err = error_of(item)
                await _send_json(send, err.status, err.body())
                return
            events.append(item)
            item = await self.job.next()
        if not any(ev.finish_reason for ev in events):  # cut short: the client left, or the server is stopping
            err = APIError(503, "the generation was cancelled", type="server_error")
            await _send_json(send, err.status, err.body())
            return
        await _send_json(send, 200, self.render.whole(events))

    async def _stream(self, item, send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        chunks = self.render.start()
        while item is not END and not self.job.cancelled.is_set():
            if isinstance(item, BaseException):
                chunks.append(error_of(item).body())
                break
            chunks += self.render.step(item)
            if chunks:
                await send({"type": "http.response.body", "body": b"".join(map(_sse, chunks)), "more_body": True})
                chunks = []
            item = await self.job.next()
        else:
            chunks.append("[DONE]")
        body = b"".join(_sse(c) if isinstance(c, dict) else b"data: [DONE]\n\n" for c in chunks)
        await send({"type": "http.response.body", "body": body, "more_body": False})
