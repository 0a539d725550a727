"""`gemma-ane serve`: an OpenAI-compatible HTTP server over one loaded bundle.

One engine per process: the caches hold one conversation, so a single worker thread runs the
generations one at a time, in arrival order, from a bounded queue (a full queue answers 429), and
the model's prefix reuse carries from one request to the next. Requests are validated and
tokenised before they queue, so a bad one fails at once instead of after waiting its turn.

Images come as OpenAI's image_url parts holding data: URLs; the server decodes the base64 once and checks each
file's size and its header's pixel count (Pillow, the `vision` extra) before the request queues. It never
fetches a remote URL for a client unless started with --allow-remote-images (then see gemma_ane.fetch).

Starlette and uvicorn (the `serve` extra) are imported only when an app is built, so the CLI can
register `serve` and the runtime stays usable without them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import io
import json
import logging
import math
import os
import queue
import re
import sys
import threading
import time
import uuid
from pathlib import Path

from . import fetch, grammar
from .chat import ChatError, StopError, check_stop
from .engine import Cancelled, ContextOverflow
from .images import ImageError, _pil, data_url_bytes
from .sampling import FIELDS, SamplingError, SamplingParams
from .tokens import TokenBytes
from .tools import ToolError, check_tool_choice, check_tools

log = logging.getLogger("gemma_ane.server")

API_KEY_ENV = "GEMMA_ANE_API_KEY"
TEXT_BODY = 1_000_000  # bytes: a request body without images
_END = object()  # the worker's last item for a job: nothing more will come


class APIError(Exception):
    """A request the server refuses, rendered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- the engine's worker ----------------------------------------------------------------------------


class Job:
    """One generation: its arguments, a cancel flag the worker checks between tokens (the runtime, between
    the prompt's steps and prefill batches), and the
    asyncio queue its events come back on."""

    def __init__(self, rid: str, kwargs: dict, loop: asyncio.AbstractEventLoop):
        self.id, self.kwargs, self.loop = rid, kwargs, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()

    async def next(self):
        return await self.events.get()


class Worker:
    """Owns the model: one thread runs queued jobs in order. `max_queue` jobs may wait behind the
    running one; `submit` refuses the next."""

    def __init__(self, model, max_queue: int):
        self.model, self.max_queue = model, max_queue
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._admitted = 0  # waiting + running
        self._thread: threading.Thread | None = None
        self.current: Job | None = None

    @property
    def waiting(self) -> int:
        return self._admitted - (self.current is not None)

    def submit(self, job: Job) -> bool:
        with self._lock:
            if self._admitted > self.max_queue:
                return False
            self._admitted += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gemma-ane-engine", daemon=True)
                self._thread.start()
        self._jobs.put(job)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything and let the thread finish its current token."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        for job in list(self._jobs.queue):
            if job is not None:
                job.cancel()
        if self.current is not None:
            self.current.cancel()
        self._jobs.put(None)
        thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self.current = job
            try:
                if not job.cancelled.is_set():
                    self._generate(job)
            finally:
                self.current = None
                with self._lock:
                    self._admitted -= 1
                job.put(_END)

    def _generate(self, job: Job) -> None:
        tokens = 0
        # asked during the prompt's processing too: a client gone while a long prompt runs frees the engine
        events = self.model.stream_generate(**job.kwargs, cancelled=job.cancelled.is_set)
        try:
            for ev in events:
                job.put(ev)
                tokens += ev.token is not None
                if job.cancelled.is_set():
                    # closing the generator at a yield leaves the caches and `cached` in step
                    log.info("%s: client gone, generation stopped after %d tokens", job.id, tokens)
                    return
        except Cancelled as e:
            log.info("%s: client gone, %s", job.id, e)
        except ValueError as e:  # the request's fault (sampling, template, context): reported as 400
            log.info("%s: refused: %s", job.id, e)
            job.put(e)
        except Exception as e:
            log.exception("%s: generation failed", job.id)
            job.put(e)
        finally:
            events.close()


# -- token strings for logprobs -----------------------------------------------------------------


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


# -- request parsing ------------------------------------------------------------------------------

_JSON_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "an object",
    list: "an array",
    type(None): "null",
}
NUMBER = (int, float)


def _field(body: dict, name: str, kind, default=None, param: str | None = None):
    """body[name] if present and of the JSON type `kind` (a missing key and null both give default);
    `param`: the field's path in the request, if not `name`."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        want, param = "a number" if kind is NUMBER else _JSON_NAMES[kind], param or name
        got = _JSON_NAMES.get(type(value), type(value).__name__)
        raise APIError(400, f"{param}: expected {want}, got {got}", param=param)
    return value


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What the images of one request may be; each is checked before the request queues."""

    max_image_bytes: int = 10_000_000  # an image's file, decoded from base64
    max_image_pixels: int = 40_000_000  # width * height, from the file's header
    max_images: int = 4  # in one request: with the bytes, bounds the body a vision bundle admits (~54 MB)
    # fetch http(s) image URLs (serve --allow-remote-images). Off by default: the server then fetches nothing for a
    # client. On, only public addresses are fetched (see gemma_ane.fetch)...
    remote_images: bool = False
    # ...and these hosts and networks (serve --allow-fetch-from): addresses, CIDR networks or host names
    allow_fetch_from: tuple[str, ...] = ()

    def __post_init__(self):
        for name, low in (("max_image_bytes", 1), ("max_image_pixels", 1), ("max_images", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= {low}")
        fetch.Allowlist(self.allow_fetch_from)  # a bad entry is refused before a bundle loads

    def max_body(self, model) -> int:
        """The default body limit: text, plus max_images files as base64 when the model takes images."""
        if getattr(model, "images", None) is None:
            return TEXT_BODY
        return TEXT_BODY + self.max_images * 4 * -(-self.max_image_bytes // 3)


def _messages(body: dict, model, limits: ImageLimits, fetched: dict) -> list[dict]:
    messages = _field(body, "messages", list)
    if not messages:
        raise APIError(400, "messages: expected a non-empty array of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"{where}: expected an object with a string 'role'", param=where)
        content = m.get("content")
        if isinstance(content, list):
            content = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        elif content is not None and not isinstance(content, str):
            raise APIError(
                400, f"{where}.content: expected a string or an array of content parts", param=f"{where}.content"
            )
        # OpenAI's newer clients send system prompts as "developer"
        message = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        # the template names a result by its call's id (or the message's name), and replays the reasoning
        # of a turn still answering the last user message (a tool loop)
        for key in ("tool_call_id", "name", "reasoning_content"):
            if m.get(key) is not None:
                message[key] = _field(m, key, str, param=f"{where}.{key}")
        if m.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(message)
    _images(out, model, limits, fetched)
    return out


def _part(part, where: str) -> dict:
    """A content part, checked for its shape: text, or OpenAI's image_url (a URL string, or {"url": ..., "detail":
    ...}; detail has no effect, the bundle fixes an image's soft tokens). A copy: _images replaces the image's."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return dict(part)
    if kind == "image_url":
        url = part.get("image_url")
        detail = url.get("detail") if isinstance(url, dict) else None
        if not isinstance(url.get("url") if isinstance(url, dict) else url, str):
            want = "{'url': 'data:image/png;base64,...'} or a URL string"
            raise APIError(400, f"{where}.image_url: expected {want}", param=f"{where}.image_url")
        if detail not in (None, "auto", "low", "high"):
            param = f"{where}.image_url.detail"
            raise APIError(400, f"{param}={detail!r}: expected 'auto', 'low' or 'high'", param=param)
        return dict(part)
    if kind == "text" or not isinstance(kind, str):
        raise APIError(400, f"{where}: expected {{'type': 'text', 'text': a string}} or an image_url part", param=where)
    raise APIError(400, f"{where}: part type {kind!r} is not supported (text and image_url)", param=where)


def _images(messages: list[dict], model, limits: ImageLimits, fetched: dict) -> None:
    """Replaces each image_url part by {"type": "image", "image": the file's bytes}, as the runtime takes it, once
    the request is within every limit: the model takes images, their count, then each file's size and pixels."""
    found = [
        (m["content"], j, f"messages[{i}].content[{j}]")
        for i, m in enumerate(messages)
        if isinstance(m["content"], list)
        for j, p in enumerate(m["content"])
        if p["type"] == "image_url"
    ]
    if not found:
        return
    if getattr(model, "images", None) is None:
        where = found[0][2]
        raise APIError(400, f"{where}: this model takes no images (its bundle has no vision model)", param=where)
    if len(found) > limits.max_images:
        message = f"messages: {len(found)} images, more than the {limits.max_images} a request may hold"
        raise APIError(400, message, param="messages")
    for i, m in enumerate(messages):
        parts = m["content"] if isinstance(m["content"], list) else []
        image = next((j for j, p in enumerate(parts) if p["type"] == "image_url"), None)
        why = _no_images_here(messages, i) if image is not None else None
        if why:
            where = f"messages[{i}].content[{image}]"
            raise APIError(400, f"{where}: {why}; send images in user messages", param=where)
    for content, j, where in found:
        url = content[j]["image_url"]
        content[j] = {"type": "image", "image": _image_file(url, f"{where}.image_url", limits, fetched)}


def _no_images_here(messages: list[dict], i: int) -> str | None:
    """Why the chat template would drop the images of messages[i] (their placeholders never rendered), or None."""
    role = messages[i]["role"]
    if role == "system" and i == 0:
        return "a leading system message cannot hold images (the template renders only its text)"
    if role == "tool":
        k = i
        while k > 0 and messages[k - 1]["role"] == "tool":
            k -= 1
        if k == 0 or not messages[k - 1].get("tool_calls"):
            return "a tool message that answers no assistant tool_calls cannot hold images (the template drops it)"
    if role not in ("user", "assistant", "system", "tool"):
        return f"a {role!r} message cannot hold images"
    return None


def remote_urls(body: dict, model, limits: ImageLimits) -> list[str]:
    """The http(s) image URLs of a chat request to fetch before it is checked: none unless remote images are on,
    the model takes images and the request holds no more than max_images (it is refused otherwise)."""
    messages = body.get("messages")
    if not limits.remote_images or getattr(model, "images", None) is None or not isinstance(messages, list):
        return []
    urls, images = [], 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_url":
                images += 1
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if isinstance(url, str) and url.startswith(("http://", "https://")):
                    urls.append(url)
    return urls if images <= limits.max_images else []


def _image_file(url, where: str, limits: ImageLimits, fetched: dict) -> bytes:
    """The file a data: URL holds, or with remote_images the one an http(s) URL served (`fetched`: by URL, None
    for a failed fetch), within the limits; a remote URL is otherwise refused (never fetched)."""
    url = url["url"] if isinstance(url, dict) else url
    try:
        if limits.remote_images and url.startswith(("http://", "https://")):
            data = fetched.get(url)
            if data is None:
                raise ImageError(f"{where}: {fetch.failure(url)}")
        else:
            data = data_url_bytes(url, where)
        if len(data) > limits.max_image_bytes:
            message = f"{where}: the image is {len(data)} bytes, more than the limit of {limits.max_image_bytes}"
            raise APIError(413, message, param=where, code="image_too_large")
        width, height = _image_size(data, where)
    except ImageError as e:
        raise APIError(400, str(e), param=where) from None
    if width * height > limits.max_image_pixels:
        message = f"{where}: {width}x{height} pixels, more than the limit of {limits.max_image_pixels}"
        raise APIError(413, message, param=where, code="image_too_large")
    return data


def _image_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) from the file's header: Pillow's open decodes no pixels (the runtime does, once)."""
    Image, _ = _pil()
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except Image.UnidentifiedImageError:
        raise ImageError(f"{where}: not an image (or in a format Pillow cannot read)") from None
    except Image.DecompressionBombError as e:  # over twice Pillow's MAX_IMAGE_PIXELS: the runtime refuses it too
        raise APIError(413, f"{where}: {' '.join(str(e).split())}", param=where, code="image_too_large") from None
    except Exception as e:  # a header cut short or damaged: SyntaxError, OSError, struct.error...
        detail = " ".join(str(e).split())
        raise ImageError(f"{where}: truncated or corrupt header ({type(e).__name__}: {detail})") from None


def _tool_calls(calls, where: str) -> list:
    """An assistant message's calls, as OpenAI clients send them back (arguments a JSON string, parsed later
    by tools.prepare_messages; a mapping is taken too)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where}: expected an array of tool calls", param=where)
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(f, dict)
            or c.get("type", "function") != "function"
            or not isinstance(c.get("id", ""), str)
            or not isinstance(f.get("name"), str)
            or not isinstance(f.get("arguments"), (str, dict))
        ):
            want = "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': a JSON string}}"
            raise APIError(400, f"{where}[{j}]: expected {want}", param=f"{where}[{j}]")
    return calls


def _stop(body: dict) -> list[str] | None:
    try:
        return [s for s in check_stop(body.get("stop")) if s] or None
    except StopError as e:
        raise APIError(400, str(e), param=e.param) from None


def _max_tokens(body: dict, names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = _field(body, name, int)
        if value is not None:
            if value < 1:
                raise APIError(400, f"{name}={value}: must be >= 1", param=name)
            return value
    return default


# Fields of OpenAI's two endpoints this server does not implement, and the one value of each that
# asks for nothing (_ANY: every value is refused, [] and "none" included). Answering with plain
# text as if they were honoured would look like success to a client that relies on them; null
# counts as absent, as for every field.
_ANY = object()
_FUNCTIONS = "the deprecated functions API is not supported; use tools and tool_choice"
UNSUPPORTED = {
    "chat": {
        "functions": (_ANY, _FUNCTIONS),
        "function_call": (_ANY, _FUNCTIONS),
        "n": (1, "only n=1 is supported"),
        "modalities": (["text"], "only text output is supported"),
        "audio": (_ANY, "audio output is not supported"),
        "prediction": (_ANY, "predicted outputs are not supported"),
        "web_search_options": (_ANY, "web search is not supported"),
        "reasoning_effort": (_ANY, "not supported; switch thinking with chat_template_kwargs.enable_thinking"),
        "verbosity": (_ANY, "not supported"),
        "moderation": (_ANY, "moderation is not supported"),
    },
    "completion": {
        "n": (1, "only n=1 is supported"),
        "best_of": (1, "only best_of=1 is supported"),
        "echo": (False, "not supported"),
        "suffix": ("", "insertion (suffix) is not supported"),
    },
}


def _refuse_unsupported(body: dict, kind: str) -> None:
    for name, (allowed, why) in UNSUPPORTED[kind].items():
        value = body.get(name)
        if value is not None and (allowed is _ANY or value != allowed or type(value) is not type(allowed)):
            raise APIError(400, f"{name}: {why}", param=name)


class Request:
    """A validated generation request: what to pass to `stream_generate` and how to answer."""

    def __init__(self, kind: str, kwargs: dict, stream: bool, include_usage: bool, logprobs: int | None):
        self.kind, self.kwargs, self.stream = kind, kwargs, stream
        self.include_usage, self.logprobs = include_usage, logprobs
        self.prompt_tokens = 0


def parse_request(
    body: dict, kind: str, model, model_name: str, limits: ImageLimits = ImageLimits(), fetched: dict | None = None
) -> Request:
    """Check every field's type and range, and the images against `limits` (nothing about the prompt's
    length: that needs the tokenizer, see `prepare`). `fetched`: the files of `remote_urls(body)` by URL (None
    for a failed fetch), as a fetch.Fetcher returns them; a remote URL missing there counts as a failed fetch."""
    name = _field(body, "model", str)
    if name is not None and name != model_name:
        raise APIError(
            404,
            f"The model `{name}` does not exist: this server runs `{model_name}`",
            param="model",
            code="model_not_found",
        )
    _refuse_unsupported(body, kind)
    stream = _field(body, "stream", bool, False)
    options = _field(body, "stream_options", dict, {})
    include_usage = _field(options, "include_usage", bool, False)
    # the sampling fields as declared (logprobs, whose shape differs by endpoint, below)
    sampling = {
        f.name: _field(body, f.name, NUMBER if f.kind is float else f.kind) for f in FIELDS if f.name != "logprobs"
    }
    kwargs = {"stop": _stop(body)}
    if kind == "chat":
        kwargs["messages"] = _messages(body, model, limits, fetched or {})
        template_kwargs = _field(body, "chat_template_kwargs", dict, {})
        kwargs["enable_thinking"] = _field(
            template_kwargs, "enable_thinking", bool, _field(body, "enable_thinking", bool, False)
        )
        kwargs.update(_tooling(body, model, kwargs["enable_thinking"]))
        want = _field(body, "logprobs", bool, False)
        top = _field(body, "top_logprobs", int)
        if top is not None and not want:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
        logprobs = (top or 0) if want else None
        kwargs["max_tokens"] = _max_tokens(body, ("max_completion_tokens", "max_tokens"), model.context)
        lp_param = "top_logprobs"
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # the legacy API takes a batch; one prompt is all this server runs
        if not isinstance(prompt, str):
            raise APIError(400, "prompt: expected a string", param="prompt")
        kwargs.update(prompt=prompt, raw=True)
        logprobs = _field(body, "logprobs", int)
        kwargs["max_tokens"] = _max_tokens(body, ("max_tokens",), 16)  # the legacy API's default
        lp_param = "logprobs"
    sampling["logprobs"] = logprobs
    if getattr(model, "head", "logits") != "logits":  # the published head: chunk_3 returns the argmax alone
        for param, given in ((lp_param, logprobs), ("logit_bias", sampling["logit_bias"])):
            if given is not None:
                raise APIError(400, f"{param}: this bundle's head returns only the chosen token", param=param)
    try:
        params = SamplingParams.from_generation_config(
            model.generation, vocab_size=model.config["vocab_size"], **sampling
        )
    except SamplingError as e:
        if e.param == "logprobs":  # named as this endpoint's client spelled it
            raise APIError(400, str(e).replace("logprobs=", f"{lp_param}=", 1), param=lp_param) from None
        raise APIError(400, str(e), param=e.param) from None
    sampling["logit_bias"] = params.logit_bias  # its ids as ints
    kwargs.update(sampling)
    return Request(kind, kwargs, stream, include_usage, logprobs)


def _tooling(body: dict, model, thinking: bool) -> dict:
    """tools, tool_choice, parallel_tool_calls and response_format, checked as the runtime will use them, the
    grammar they constrain the output to included: a request that cannot run is refused before it queues."""
    parallel = _field(body, "parallel_tool_calls", bool, True)
    response_format = _field(body, "response_format", dict)
    tools, choice = body.get("tools"), body.get("tool_choice")
    try:
        tools = None if tools is None else check_tools(tools)
        choice = check_tool_choice("auto" if choice is None else choice, tools)
        field = "response_format" if choice in ("auto", "none") else "tool_choice"  # what asks for a grammar
        constrained = grammar.request_grammar(tools, choice, parallel, response_format, thinking=thinking)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from None
    except grammar.GrammarError as e:  # without a param: llguidance is missing
        raise APIError(400, str(e), param=e.param or field) from None
    if constrained and getattr(model, "head", "logits") != "logits":
        raise APIError(
            400,
            f"{field}: constrained decoding needs logits; this bundle's head returns only the chosen token",
            param=field,
        )
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel, "response_format": response_format}


def prepare(model, req: Request) -> None:
    """The runtime's request built from `req` before it queues (Model.prepare: every check, the template rendered
    once, the grammar compiled once), so the worker only runs it; its prompt's length in req.prompt_tokens. A
    model without `prepare` (build_app's least contract) has its prompt counted by prompt_ids instead."""
    kw, param = req.kwargs, "messages" if req.kind == "chat" else "prompt"
    build = getattr(model, "prepare", None)
    try:
        if build is None:
            tools = {"tools": kw["tools"]} if kw.get("tools") else {}  # a model without function calling takes none
            names = ("prompt", "messages", "raw", "enable_thinking")
            ids = model.prompt_ids(**{k: kw[k] for k in names if k in kw}, **tools)
        else:
            prepared = build(**kw)
            ids, req.kwargs = prepared.ids, {"request": prepared}
    except ChatError as e:
        raise APIError(400, str(e), param=param) from None
    except (ToolError, SamplingError) as e:  # a call's arguments that are no JSON object; bans that leave no token
        raise APIError(400, str(e), param=e.param) from None
    except grammar.GrammarError as e:  # the grammar this tokenizer cannot spell: what asked for it is named
        field = "response_format" if kw.get("tool_choice", "auto") in ("auto", "none") else "tool_choice"
        raise APIError(400, str(e), param=e.param or field) from None
    if len(ids) > model.context:
        raise APIError(
            400,
            f"the prompt is {len(ids)} tokens, more than the model's context of {model.context}",
            param=param,
            code="context_length_exceeded",
        )
    req.prompt_tokens = len(ids)


# -- responses ------------------------------------------------------------------------------------


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


_PART = re.compile(r"messages\[\d+\]\.content\[\d+\]")


def _error_of(exc: BaseException) -> APIError:
    if isinstance(exc, ContextOverflow):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, ImageError):  # found by the runtime as it decodes: the message names the part
        part = _PART.match(str(exc))
        return APIError(400, str(exc), param=part.group(0) if part else "messages")
    if isinstance(exc, ValueError):  # SamplingError, ChatError, a bundle that cannot sample
        return APIError(400, str(exc))
    return APIError(500, "the generation failed; see the server log", type="server_error")


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
            if first is _END:
                err = APIError(503, "the server is shutting down", type="server_error")
                await _send_json(send, err.status, err.body())
            elif isinstance(first, BaseException):
                err = _error_of(first)
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
        while item is not _END:
            if isinstance(item, BaseException):
                err = _error_of(item)
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
        while item is not _END and not self.job.cancelled.is_set():
            if isinstance(item, BaseException):
                chunks.append(_error_of(item).body())
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


# -- the app --------------------------------------------------------------------------------------


def _image_url_chars(body: dict) -> int:
    """The characters of a chat request's image_url URLs: the part of the body the image allowance is for."""
    messages = body.get("messages")
    total = 0
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                total += len(url) if isinstance(url, str) else 0
    return total


async def _read_json(request, max_body: int, text_body: int) -> dict:
    """The body as a JSON object, of at most max_body bytes, of which at most text_body outside image_url URLs (a
    vision bundle's allowance for images is no allowance for text: stop strings, prompts, tools)."""
    from starlette.requests import ClientDisconnect

    too_big = APIError(413, f"the request body is larger than {max_body} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_body:
        raise too_big
    data = bytearray()
    try:
        async for chunk in request.stream():
            data += chunk
            if len(data) > max_body:
                raise too_big
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body") from None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    if len(data) > text_body:
        text = len(data) - _image_url_chars(body)
        if text > text_body:
            message = f"the request body holds {text} bytes besides its images, more than {text_body}"
            raise APIError(413, message, code="request_too_large")
    return body


def build_app(
    model,
    *,
    model_name: str,
    api_key: str | None = None,
    max_queue: int = 16,
    max_body: int | None = None,
    max_image_bytes: int = ImageLimits.max_image_bytes,
    max_image_pixels: int = ImageLimits.max_image_pixels,
    max_images: int = ImageLimits.max_images,
    remote_images: bool = False,
    allow_fetch_from=(),
):
    """The Starlette app serving `model` (anything with `stream_generate`, `prompt_ids` (given `tools=` only
    when a request has tools), `context`, `generation`, `config` (its `vocab_size`) and `tokenizer`, as
    `gemma_ane.load` returns; `images`, its image encoder or None). `max_body` defaults to 1 MB, plus room for
    `max_images` base64 images of `max_image_bytes` when the model takes images (in their image_url parts only);
    `remote_images`: fetch http(s) image URLs on public addresses and those `allow_fetch_from` names (off:
    refused)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    if max_queue < 0:
        raise ValueError(f"max_queue={max_queue}: must be >= 0")
    limits = ImageLimits(max_image_bytes, max_image_pixels, max_images, remote_images, tuple(allow_fetch_from))
    # the image allowance counts only inside image_url parts; a max_body given is the limit of both
    text_body = TEXT_BODY if max_body is None else max_body
    max_body = limits.max_body(model) if max_body is None else max_body
    worker = Worker(model, max_queue)
    fetcher = fetch.Fetcher(fetch.Allowlist(limits.allow_fetch_from), max_image_bytes) if remote_images else None
    vocab = Vocab(model.tokenizer)
    started = int(time.time())

    def authorize(request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401, "missing or incorrect API key (send 'Authorization: Bearer KEY')", code="invalid_api_key"
            )

    async def health(request):
        return JSONResponse(
            {"status": "ok", "model": model_name, "generating": worker.current is not None, "waiting": worker.waiting}
        )

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "gemma-ane"}

    async def models(request):
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request):
        authorize(request)
        if request.path_params["name"] != model_name:
            raise APIError(
                404, f"The model `{request.path_params['name']}` does not exist", param="model", code="model_not_found"
            )
        return JSONResponse(model_card())

    def endpoint(kind: str, prefix: str):
        async def generate(request):
            authorize(request)
            body = await _read_json(request, max_body, text_body)
            # remote images are fetched on a pool of their own, awaited here: a slow one holds no shared thread
            urls = remote_urls(body, model, limits) if fetcher is not None and kind == "chat" else []
            fetched = await fetcher(urls) if urls else {}
            req = await run_in_threadpool(parse_request, body, kind, model, model_name, limits, fetched)
            await run_in_threadpool(prepare, model, req)
            rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
            job = Job(rid, req.kwargs, asyncio.get_running_loop())
            if not worker.submit(job):
                raise APIError(
                    429,
                    f"the queue is full ({max_queue} requests waiting); retry shortly",
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            return Generation(job, Render(req, rid, model_name, vocab))

        return generate

    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request, exc):
        code = "not_found" if exc.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            APIError(exc.status_code, message, code=code).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def server_error(request, exc):
        # the traceback goes to the server's log (Starlette re-raises after this), never to the client
        return JSONResponse(APIError(500, "internal server error", type="server_error").body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(worker.stop)
        if fetcher is not None:
            fetcher.close()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", one_model, methods=["GET"]),
            Route("/v1/chat/completions", endpoint("chat", "chatcmpl"), methods=["POST"]),
            Route("/v1/completions", endpoint("completion", "cmpl"), methods=["POST"]),
        ],
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.worker = worker
    return app


def serve(
    bundle,
    host: str = "127.0.0.1",
    port: int = 8080,
    backend: str = "auto",
    api_key: str | None = None,
    max_queue: int = 16,
    prompt_cache: str | None = None,
    allow_special_tokens: bool = False,
    draft_tokens: int = 0,
    max_image_bytes: int = ImageLimits.max_image_bytes,
    max_image_pixels: int = ImageLimits.max_image_pixels,
    max_images: int = ImageLimits.max_images,
    remote_images: bool = False,
    allow_fetch_from=(),
) -> None:
    """Load `bundle` and serve it until interrupted; `prompt_cache`: start from the caches in this
    file (made by `generate`/`chat --prompt-cache`), so a shared system prompt is not processed again;
    `max_image_*`, `max_images`, `remote_images`: what one request's images may be (see ImageLimits)."""
    import uvicorn

    from .runtime import load

    if not 0 <= port <= 65535:
        raise ValueError(f"port={port}: expected 0..65535")
    if max_queue < 0:
        raise ValueError(f"max_queue={max_queue}: must be >= 0")
    # checked before loading
    limits = ImageLimits(max_image_bytes, max_image_pixels, max_images, remote_images, tuple(allow_fetch_from))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach it can use the model", host)
    if remote_images:
        log.warning("--allow-remote-images: requests may make this server fetch http(s) URLs on public addresses")
    model = load(bundle, backend=backend)
    model.allow_special_tokens = allow_special_tokens
    model.use_drafts(draft_tokens)
    if prompt_cache:
        log.info("prompt cache %s: %d tokens", prompt_cache, model.load_prompt_cache(prompt_cache))
    app = build_app(
        model,
        model_name=Path(bundle).resolve().name,
        api_key=api_key,
        max_queue=max_queue,
        **dataclasses.asdict(limits),
    )
    # a stream still open at shutdown is cut after 5 s rather than holding the process
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


# -- command line ---------------------------------------------------------------------------------


def _cmd_serve(a) -> int:
    serve(
        a.bundle,
        host=a.host,
        port=a.port,
        backend=a.backend,
        api_key=a.api_key or os.environ.get(API_KEY_ENV),
        max_queue=a.max_queue,
        prompt_cache=a.prompt_cache,
        allow_special_tokens=a.allow_special_tokens,
        draft_tokens=a.draft,
        max_image_bytes=a.max_image_bytes,
        max_image_pixels=a.max_image_pixels,
        max_images=a.max_images,
        remote_images=a.allow_remote_images,
        allow_fetch_from=a.allow_fetch_from,
    )
    return 0


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--backend", default="auto", choices=["auto", "coreml", "mil"])
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}, else none)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait behind the running one; more get 429 (default 16)",
    )
    p.add_argument("--prompt-cache", metavar="FILE", help="start from the caches saved in FILE (see generate)")
    p.add_argument(
        "--allow-special-tokens",
        action="store_true",
        help="let user and tool text spell control tokens (default: it stays text, so no one can forge a turn)",
    )
    p.add_argument(
        "--draft",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding for every request: the bundle's drafter proposes K tokens a verify call",
    )
    limits = ImageLimits()
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=limits.max_image_bytes,
        metavar="N",
        help=f"largest image file a request may send, decoded from base64 (default {limits.max_image_bytes})",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=limits.max_image_pixels,
        metavar="N",
        help=f"largest width*height of an image (default {limits.max_image_pixels})",
    )
    p.add_argument(
        "--max-images",
        type=int,
        default=limits.max_images,
        metavar="N",
        help=f"most images in one request (default {limits.max_images})",
    )
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch http(s) image URLs a request names, on public addresses only (default: only data: URLs; the "
        f"server fetches nothing); {fetch.FETCH_SECONDS:g} s a fetch",
    )
    p.add_argument(
        "--allow-fetch-from",
        action="append",
        default=[],
        metavar="CIDR_OR_HOST",
        help="with --allow-remote-images, also fetch from this address, network or host though it is not public "
        "(loopback, private, link-local); repeatable",
    )
    p.set_defaults(fn=_cmd_serve)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `gemma-ane serve` on the CLI's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra)")
    _arguments(p)
    return p


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gemma_ane.server", description="OpenAI-compatible HTTP server")
    _arguments(p)
    a = p.parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, OSError) as e:  # bundle, backend and argument errors: one line, as the CLI does
        print(f"gemma-ane serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
