"""The server's responses: the runtime's events rendered as OpenAI's objects, whole or as a stream of chunks
(Render), and the ASGI response that waits on a queued job and sends them (Generation)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time

from ..runtime.tokens import TokenBytes
from .errors import APIError, error_of
from .request import APIRequest
from .worker import END, Echo, Job


class Vocab:
    """Each token's own string and bytes, as OpenAI's logprobs report them. A token that is part of a
    multi-byte character decodes to U+FFFD on its own, so its bytes come from its piece (tokens.TokenBytes).
    `stop_ids`: the tokens that end a turn; no text is theirs, so no logprobs either."""

    def __init__(self, tokenizer, stop_ids=()):
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self._bytes = TokenBytes(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._silent: dict[int, bool] = {}

    def silent(self, token: int) -> bool:
        """Whether the token has no text of its own (a control token): nothing of it is ever held back."""
        if token not in self._silent:
            self._silent[token] = self.tokenizer.decode([token], skip_special_tokens=True) == ""
        return self._silent[token]

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


class _Choice:
    """One choice's state as it renders."""

    def __init__(self, index: int):
        self.index = index
        self.tokens = 0  # completion tokens
        self.held: list = []  # token events whose text is not out yet: their logprobs go with it
        self.offset = 0  # legacy logprobs' text_offset
        self.calls = 0  # tool calls streamed so far: the next one's index
        self.done = False


class Render:
    """Turns the runtime's events into OpenAI response objects: whole, or as stream chunks. Logprobs cover
    the emitted text: a token's go out with the text (or reasoning, or call) it released, so a token whose
    text never comes out (a turn's end, a stop string, a character or call cut short) reports none."""

    def __init__(self, req: APIRequest, rid: str, model_name: str, vocab: Vocab):
        self.req, self.id, self.model, self.vocab = req, rid, model_name, vocab
        self.chat = req.kind == "chat"
        self.created = int(time.time())
        self.prompt_tokens = req.prompt_tokens  # prepare's; the last event's replaces it (see _ended)
        self.cached_tokens = 0  # prompt tokens the model's caches already held (the last event says)
        self.speeds = (0.0, 0.0)  # the first choice's prompt and generation tokens a second (the last event says)
        self.choices = [_Choice(i) for i in range(req.n)]
        self.echo_scores: list | None = None  # Model.prompt_logprobs's, when echo asked for logprobs

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def _envelope(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _ended(self, ev) -> None:
        """Takes the prompt's counts from a generation's last event. Its prompt_tokens is the runtime's, with
        each image's soft tokens (prepare saw one placeholder an image); a model reporting 0 keeps ours. The
        first choice's reuse is the request's: the later ones reuse the prompt it left."""
        if len(self.req.prompts) == 1:  # a batch's prompts were each counted by prepare
            self.prompt_tokens = ev.prompt_tokens or self.prompt_tokens
        if all(not c.done for c in self.choices):
            self.cached_tokens = ev.reused_tokens
            self.speeds = (ev.prefill_tokens_per_s, ev.decode_tokens_per_s)

    def usage(self) -> dict:
        p, c = self.prompt_tokens, self.completion_tokens
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _released(self, c: _Choice, ev) -> list:
        """The token events whose logprobs go out with `ev`'s output: none until it releases text, reasoning or
        a call, then every one held since; a token without text of its own (a control token) with nothing held
        before it goes out at once, and a turn's end token never."""
        c.tokens += ev.token is not None
        if ev.token is not None and ev.token not in self.vocab.stop_ids:
            c.held.append(ev)
        if not (ev.text or ev.reasoning or ev.tool_calls or c.held == [ev] and self.vocab.silent(ev.token)):
            return []
        out, c.held = c.held, []
        if self.chat:  # logprobs.content covers the content alone: no thought, no call markup, no control token
            return [e for e in out if not self.vocab.silent(e.token)] if ev.text else []
        return out

    def _entries(self, c: _Choice, scored) -> dict:
        """The logprobs object of `scored` ((token, logprob, top) each), in the endpoint's format; legacy
        top_logprobs hold the `logprobs` most likely and the chosen token (the chosen alone for logprobs=0: OpenAI
        always returns the sampled token's, as vLLM does)."""
        if self.chat:

            def entry(token, lp):
                text, raw = self.vocab(token)
                return {"token": text, "logprob": _lp(lp), "bytes": raw}

            content = [{**entry(t, lp), "top_logprobs": [entry(a, x) for a, x in top]} for t, lp, top in scored]
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp, top in scored:
            text = self.vocab(token)[0]
            alternatives = {self.vocab(a)[0]: _lp(x) for a, x in top}
            if lp is not None:
                alternatives.setdefault(text, _lp(lp))
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else _lp(lp))
            out["top_logprobs"].append(alternatives if lp is not None else None)
            out["text_offset"].append(c.offset)
            c.offset += len(text)
        return out

    def _logprobs(self, c: _Choice, events) -> dict | None:
        if self.req.logprobs is None:
            return None
        return self._entries(c, [(ev.token, ev.logprob, ev.top_logprobs) for ev in events])

    def _echo(self, c: _Choice) -> tuple[str, dict | None]:
        """A completion's echoed prompt and its tokens' logprobs (the <bos> the runtime adds to a text prompt is not
        echoed; a prompt of ids is echoed whole). The first echoed token's logprob is null, as OpenAI's and vLLM's:
        nothing the client sent comes before it."""
        if self.req.logprobs is None:
            return self.req.prompt_text, None
        skip = self.req.echo_from
        scores = (self.echo_scores or [])[skip:]
        ids = self.req.prompt_ids[skip:]
        scored = [
            (t, None, []) if s is None or i == 0 else (t, s[0], s[1]) for i, (t, s) in enumerate(zip(ids, scores))
        ]
        return self.req.prompt_text, self._entries(c, scored)

    def timings(self) -> dict:
        """llama.cpp's `timings` beside `usage`: what a page shows under an answer (prompt tokens processed and
        reused, both speeds)."""
        return {
            "prompt_n": self.prompt_tokens - self.cached_tokens,
            "cache_n": self.cached_tokens,
            "prompt_per_second": self.speeds[0],
            "predicted_n": self.completion_tokens,
            "predicted_per_second": self.speeds[1],
        }

    @staticmethod
    def _join(a: dict | None, b: dict | None) -> dict | None:
        if a is None or b is None:
            return a or b
        return {k: a[k] + b[k] for k in a}

    def whole(self, items: list) -> dict:
        by_choice = [[ev for i, ev in items if i == c.index] for c in self.choices]
        out = []
        for c, events in zip(self.choices, by_choice):
            released = [r for ev in events for r in self._released(c, ev)]
            self._ended(events[-1])  # Generation renders only generations that finished
            c.done = True
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
                logprobs = self._logprobs(c, released)
                out.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                echoed, logprobs = self._echo(c) if self.req.echo else ("", None)
                logprobs = self._join(logprobs, self._logprobs(c, released))
                out.append({"index": c.index, "text": echoed + text, "logprobs": logprobs, "finish_reason": finish})
        return {**self._envelope(False), "choices": out, "usage": self.usage(), "timings": self.timings()}

    def _chunk(self, c: _Choice, choice: dict) -> dict:
        out = {**self._envelope(True), "choices": [{"index": c.index, **choice}]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def _call_deltas(self, c: _Choice, call) -> list[dict]:
        """A call as OpenAI streams one: its id and name, then its arguments in fragments. The runtime has the
        call whole when it closes; a few fragments keep clients honest that must concatenate them."""
        index, f = c.calls, call.to_openai()
        c.calls += 1
        arguments = f["function"]["arguments"]
        head = {"index": index, "id": f["id"], "type": "function", "function": {"name": call.name, "arguments": ""}}
        size = max(1, -(-len(arguments) // 3))
        parts = [arguments[i : i + size] for i in range(0, len(arguments), size)]
        return [{"tool_calls": [head]}] + [
            {"tool_calls": [{"index": index, "function": {"arguments": p}}]} for p in parts
        ]

    def start(self) -> list[dict]:
        """Each choice's first chunk: its role (chat), or its echoed prompt (a completion with echo)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            return [self._chunk(c, {"delta": delta, "logprobs": None, "finish_reason": None}) for c in self.choices]
        if not self.req.echo:
            return []
        out = []
        for c in self.choices:
            text, logprobs = self._echo(c)
            out.append(self._chunk(c, {"text": text, "logprobs": logprobs, "finish_reason": None}))
        return out

    def step(self, item) -> list[dict]:
        """The chunks for one (choice index, event): its text and reasoning (with the logprobs of the tokens
        they release), then, on its last event, the finish reason, and after the last choice's, the usage (if
        asked for)."""
        index, ev = item
        c = self.choices[index]
        out = []
        released = self._released(c, ev)
        lp = self._logprobs(c, released) if released else None
        if self.chat:
            delta = {}
            if ev.reasoning:
                delta["reasoning_content"] = ev.reasoning
            if ev.text:
                delta["content"] = ev.text
            deltas = ([delta] if delta else []) + [d for call in ev.tool_calls for d in self._call_deltas(c, call)]
            # the tokens' logprobs go with the first delta they released (a control token's: with an empty one)
            for i, d in enumerate(deltas or ([{}] if lp else [])):
                out.append(self._chunk(c, {"delta": d, "logprobs": lp if i == 0 else None, "finish_reason": None}))
        elif ev.text or lp:
            out.append(self._chunk(c, {"text": ev.text, "logprobs": lp, "finish_reason": None}))
        if ev.finish_reason:
            self._ended(ev)
            c.done = True
            end = {"delta": {}} if self.chat else {"text": ""}
            out.append(self._chunk(c, {**end, "logprobs": None, "finish_reason": ev.finish_reason}))
            if self.req.include_usage and all(x.done for x in self.choices):
                out.append({**self._envelope(True), "choices": [], "usage": self.usage(), "timings": self.timings()})
        return out


async def send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
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
            if isinstance(first, Echo):  # the prompt's logprobs come first; the status waits for what follows
                self.render.echo_scores = first
                first = await job.next()
            if first is END:
                err = APIError(503, "the server is shutting down", type="server_error")
                await send_json(send, err.status, err.body())
            elif isinstance(first, BaseException):
                err = error_of(first)
                await send_json(send, err.status, err.body())
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
                await send_json(send, err.status, err.body())
                return
            events.append(item)
            item = await self.job.next()
        finished = {i for i, ev in events if ev.finish_reason}
        if len(finished) < self.render.req.n:  # cut short: the client left, or the server is stopping
            err = APIError(503, "the generation was cancelled", type="server_error")
            await send_json(send, err.status, err.body())
            return
        await send_json(send, 200, self.render.whole(events))

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
