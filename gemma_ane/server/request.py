"""The server's request parsing: a chat or completion body parsed once into a runtime GenerationRequest (each
field's JSON type checked, a 400 naming it; its media parts decoded and bounded by gemma_ane.server.media), then
`prepare`, which has the runtime check and build it (Model.prepare: tools, sampling and the bundle's capabilities,
each checked there once) before it queues; every error the runtime raises reaches the client through `error_of`."""

from __future__ import annotations

from dataclasses import replace

from ..errors import GemmaAneError
from ..runtime.request import GenerationRequest, Prepared
from ..runtime.sampling import FIELDS
from .errors import APIError, error_of
from .media import ImageLimits, check_audios, check_images, decode_audios

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


def _messages(body: dict, model, limits: ImageLimits, fetched: dict) -> tuple[list[dict], int]:
    """The checked messages, and the tokens their audio clips add to the prompt (check_audios)."""
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
    check_images(out, model, limits, fetched)
    return out, check_audios(out, model)


def _part(part, where: str) -> dict:
    """A content part, checked for its shape: text, or OpenAI's image_url (a URL string, or {"url": ..., "detail":
    ...}; detail has no effect, the bundle fixes an image's soft tokens). A copy: check_images replaces the image's."""
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
    if kind == "input_audio":  # its object is checked as it is decoded (check_audios), once the model is known to hear
        return dict(part)
    if kind == "text" or not isinstance(kind, str):
        raise APIError(400, f"{where}: expected {{'type': 'text', 'text': a string}} or an image_url part", param=where)
    raise APIError(400, f"{where}: part type {kind!r} is not supported (text, image_url and input_audio)", param=where)


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


def _max_tokens(body: dict, names: tuple[str, ...], default: int, least: int = 1) -> int:
    for name in names:
        value = _field(body, name, int)
        if value is not None:
            if value < least:
                raise APIError(400, f"{name}={value}: must be >= {least}", param=name)
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
        "modalities": (["text"], "only text output is supported"),
        "audio": (_ANY, "audio output is not supported"),
        "prediction": (_ANY, "predicted outputs are not supported"),
        "web_search_options": (_ANY, "web search is not supported"),
        "verbosity": (_ANY, "not supported"),
        "moderation": (_ANY, "moderation is not supported"),
    },
    "completion": {
        "best_of": (1, "only best_of=1 is supported"),
        "suffix": ("", "insertion (suffix) is not supported"),
    },
}


def _refuse_unsupported(body: dict, kind: str) -> None:
    for name, (allowed, why) in UNSUPPORTED[kind].items():
        value = body.get(name)
        if value is not None and (allowed is _ANY or value != allowed or type(value) is not type(allowed)):
            raise APIError(400, f"{name}: {why}", param=name)


class APIRequest:
    """One parsed request: the runtime's GenerationRequest (`generation`) and how to answer it: `n` choices (run
    from one Prepared, `prepared`, which prepare makes), streamed or not, with usage, logprobs; `echo`: a
    completion's text starts with its prompt, whose ids prepare keeps (`prompt_ids`, <bos> first)."""

    def __init__(
        self,
        kind: str,
        generation: GenerationRequest,
        stream: bool,
        include_usage: bool,
        logprobs: int | None,
        n: int = 1,
        echo: bool = False,
    ):
        self.kind, self.generation, self.stream = kind, generation, stream
        self.include_usage, self.logprobs = include_usage, logprobs
        self.n, self.echo = n, echo
        self.prepared: list[Prepared] = []  # one a prompt: a completion may send a batch (n choices each, in order)
        self.prompts: list = [generation.prompt]
        self.prompt_tokens = 0
        self.audio_tokens = 0  # what the audio clips add to the prompt, from their headers (check_audios)
        self.prompt_ids: list[int] = []
        self.prompt_text = generation.prompt if echo else ""  # what echo repeats
        self.echo_from = 1  # the first of prompt_ids echo repeats: a text prompt's <bos> is the server's own


MAX_N = 16  # choices in one request: each is a whole generation, run one after another
# reasoning_effort as thinking on or off: Gemma 4 thinks or does not, with no budget between
EFFORT = {"none": False, "minimal": False, "low": False, "medium": True, "high": True}


def _n(body: dict) -> int:
    n = _field(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n={n}: expected 1..{MAX_N}", param="n")
    return n


def _thinking(body: dict) -> bool:
    """Whether the answer starts with a thought: chat_template_kwargs.enable_thinking, else enable_thinking, else
    reasoning_effort (EFFORT); off when none is given."""
    template_kwargs = _field(body, "chat_template_kwargs", dict, {})
    effort = _field(body, "reasoning_effort", str)
    if effort is not None and effort not in EFFORT:
        want = ", ".join(repr(e) for e in EFFORT)
        raise APIError(400, f"reasoning_effort={effort!r}: expected one of {want}", param="reasoning_effort")
    default = EFFORT.get(effort, False)
    return _field(template_kwargs, "enable_thinking", bool, _field(body, "enable_thinking", bool, default))


def parse_request(
    body: dict, kind: str, model, model_name: str, limits: ImageLimits = ImageLimits(), fetched: dict | None = None
) -> APIRequest:
    """The body parsed into an APIRequest: every field's JSON type, and the images against `limits` (nothing the
    runtime checks: that is `prepare`'s). `fetched`: the files of `remote_urls(body)` by URL (None
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
    n, echo = _n(body), _field(body, "echo", bool, False) if kind == "completion" else False
    options = _field(body, "stream_options", dict, {})
    include_usage = _field(options, "include_usage", bool, False)
    # the sampling fields' JSON types (logprobs, whose shape differs by endpoint, below); their ranges: prepare's
    sampling = {
        f.name: _field(body, f.name, NUMBER if f.kind is float else f.kind) for f in FIELDS if f.name != "logprobs"
    }
    audio_tokens = 0
    if kind == "chat":
        (messages, audio_tokens), thinking = _messages(body, model, limits, fetched or {}), _thinking(body)
        want = _field(body, "logprobs", bool, False)
        top = _field(body, "top_logprobs", int)
        if top is not None and not want:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
        logprobs = (top or 0) if want else None
        text = {"messages": messages, "enable_thinking": thinking, **_tooling(body)}
        max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), model.context)
    else:
        prompts = _prompts(body, model)
        if echo and len(prompts) > 1:
            raise APIError(400, f"echo: one prompt a request (a batch of {len(prompts)} was given)", param="echo")
        text = {"prompt": prompts[0], "raw": True}
        logprobs = _field(body, "logprobs", int)
        # with echo, max_tokens=0 asks for the prompt alone (its logprobs: what a loglikelihood evaluation reads)
        max_tokens = _max_tokens(body, ("max_tokens",), 16, least=0 if echo else 1)  # the API's default
    generation = GenerationRequest(
        **text,
        max_tokens=max_tokens,
        stop=body.get("stop"),
        sampling={**sampling, "logprobs": logprobs},
    )
    req = APIRequest(kind, generation, stream, include_usage, logprobs, n, echo)
    req.audio_tokens = audio_tokens
    if kind == "completion":
        req.prompts, req.n = prompts, n * len(prompts)
        if echo and not isinstance(prompts[0], str):  # a prompt of ids is echoed whole, as its tokens' text
            req.prompt_text, req.echo_from = model.tokenizer.decode(prompts[0], skip_special_tokens=False), 0
    return req


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _prompts(body: dict, model) -> list:
    """OpenAI's `prompt`: a string, a list of token ids, or a batch (a list) of either; each id in the vocabulary."""
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) or _token_ids(prompt) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) or _token_ids(p) for p in prompts):
        raise APIError(400, "prompt: expected a string, a list of token ids, or a list of either", param="prompt")
    vocab = model.config["vocab_size"]
    for i, p in enumerate(prompts):
        bad = [] if isinstance(p, str) else [t for t in p if not 0 <= t < vocab]
        if bad:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise APIError(400, f"{where}: token id {bad[0]} is not in the vocabulary (0..{vocab - 1})", param="prompt")
    return prompts


def _tooling(body: dict) -> dict:
    """tools, tool_choice, parallel_tool_calls and response_format as the body gives them (prepare checks them and
    the grammar they ask for, once)."""
    choice = body.get("tool_choice")
    return {
        "tools": body.get("tools"),
        "tool_choice": "auto" if choice is None else choice,
        "parallel_tool_calls": _field(body, "parallel_tool_calls", bool, True),
        "response_format": _field(body, "response_format", dict),
    }


def prepare(model, req: APIRequest) -> None:
    """The runtime's request built from `req` before it queues (Model.prepare: every check, the template rendered
    once, the grammar compiled once), so the worker only runs it (choice i of n: Model.choice, in the worker); its
    prompt's length in req.prompt_tokens, refused here when it exceeds the context. Every error through error_of,
    named as this endpoint's client spells the field."""
    default = "messages" if req.kind == "chat" else "prompt"
    try:
        req.prepared = [model.prepare(replace(req.generation, prompt=p)) for p in req.prompts]
    except (ValueError, GemmaAneError) as e:
        error = error_of(e)
        if req.kind == "chat" and error.param == "logprobs":  # named as this endpoint's client spelled it
            error.message, error.param = error.message.replace("logprobs", "top_logprobs", 1), "top_logprobs"
        if error.status < 500:
            error.param = error.param or default
        raise error from None
    ids = max((p.ids for p in req.prepared), key=len)  # the longest of a batch decides
    n = len(ids) + req.audio_tokens  # audio counted from the headers: no clip is decoded yet
    if n > model.context:
        audio = " (audio included)" if req.audio_tokens else ""
        raise APIError(
            400,
            f"the prompt is {n} tokens{audio}, more than the model's context of {model.context}",
            param=default,
            code="context_length_exceeded",
        )
    req.prompt_tokens = sum(len(p.ids) for p in req.prepared)  # a batch's prompts, each counted
    req.prompt_ids = list(ids) if req.echo else []  # a raw prompt: <bos>, then the text's ids; or the ids given


def decode_media(model, req: APIRequest) -> None:
    """The request's audio clips decoded into its prepared media (media.decode_audios): the costly half of checking
    them, run once the request is known to fit the context and holds its place in the queue."""
    if req.audio_tokens:
        req.prepared = [decode_audios(p, model) for p in req.prepared]
