"""The server's request parsing: every field of a chat or completion request checked for its type and range (a 400
naming it), its images decoded and bounded (data: URLs, or fetched ones: gemma_ane.server.fetch), then `prepare`, which
has the runtime build the request (Model.prepare) before it queues."""

from __future__ import annotations

import dataclasses
import io
import re
import sys

from ..errors import GemmaAneError
from ..runtime import grammar
from ..runtime.chat import ChatError, StopError, check_stop
from ..runtime.images import MAX_PIXELS, ImageError, data_url_bytes, open_image
from ..runtime.sampling import FIELDS, SamplingError, SamplingParams
from ..runtime.tools import ToolError, check_tool_choice, check_tools
from . import fetch

TEXT_BODY = 1_000_000  # bytes: a request body without images


class APIError(GemmaAneError):
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
    max_image_pixels: int = MAX_PIXELS  # width * height, from the file's header
    max_images: int = 4  # in one request: with the bytes, bounds the body a vision bundle admits (~54 MB)
    # fetch http(s) image URLs (serve --allow-remote-images). Off by default: the server then fetches nothing for a
    # client. On, only public addresses are fetched (see gemma_ane.server.fetch)...
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
    """(width, height) from the file's header, in an accepted format (images.open_image: decided from the magic
    number, so no other Pillow plugin sees the bytes; no pixel decoded: the runtime does that, once). The pixel
    limit is checked by the caller, which answers 413 rather than the runtime's 400."""
    try:
        with open_image(io.BytesIO(data), where, max_pixels=sys.maxsize) as img:
            return img.size
    except ImageError:
        raise
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
    grammar they constrain the output to included (by Model.prepare, for a model that has it): a request that
    cannot run is refused before it queues."""
    parallel = _field(body, "parallel_tool_calls", bool, True)
    response_format = _field(body, "response_format", dict)
    tools, choice = body.get("tools"), body.get("tool_choice")
    try:
        tools = None if tools is None else check_tools(tools)
        choice = check_tool_choice("auto" if choice is None else choice, tools)
        field = "response_format" if choice in ("auto", "none") else "tool_choice"  # what asks for a grammar
        # a runtime Model compiles the grammar once, in prepare; a model without prepare has it checked here
        prepares = getattr(model, "prepare", None) is not None
        constrained = (
            None if prepares else grammar.request_grammar(tools, choice, parallel, response_format, thinking=thinking)
        )
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
    except ValueError as e:  # images the bundle cannot take, a bundle that cannot sample: as the worker reports them
        raise error_of(e) from None
    if len(ids) > model.context:
        raise APIError(
            400,
            f"the prompt is {len(ids)} tokens, more than the model's context of {model.context}",
            param=param,
            code="context_length_exceeded",
        )
    req.prompt_tokens = len(ids)


_PART = re.compile(r"messages\[\d+\]\.content\[\d+\]")


def error_of(exc: BaseException) -> APIError:
    """The one mapping from an error to a response: a package error by its class's `status`, `code` and
    `param` (gemma_ane.errors); any other ValueError is the request's (400), anything else the server's.
    A server error's message stays in the log: it may name the server's files."""
    if isinstance(exc, APIError):
        return exc
    status = exc.status if isinstance(exc, GemmaAneError) else 400 if isinstance(exc, ValueError) else 500
    code = exc.code if isinstance(exc, GemmaAneError) else None
    if status >= 500:
        return APIError(status, "the generation failed; see the server log", type="server_error", code=code)
    param = exc.param if isinstance(exc, GemmaAneError) else None
    if isinstance(exc, ImageError):  # found by the runtime as it decodes: the message names the part
        part = _PART.match(str(exc))
        param = part.group(0) if part else "messages"
    return APIError(status, str(exc), param=param, code=code)
