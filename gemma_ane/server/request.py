"""The server's request parsing: every field of a chat or completion request checked for its type and range (a 400
naming it), its media parts checked (gemma_ane.server.media), then `prepare`, which has the runtime build the request
(Model.prepare) before it queues."""

from __future__ import annotations

from ..runtime import grammar
from ..runtime.chat import ChatError, StopError, check_stop
from ..runtime.sampling import FIELDS, SamplingError, SamplingParams
from ..runtime.tools import ToolError, check_tool_choice, check_tools
from .errors import APIError, error_of
from .media import ImageLimits, check_audios, check_images

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
    check_images(out, model, limits, fetched)
    check_audios(out, model)
    return out


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


def _stop(body: dict) -> list[str] | None:
    try:
        return [s for s in check_stop(body.get("stop")) if s] or None
    except StopError as e:
        raise APIError(400, str(e), param=e.param) from None


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


class Request:
    """A validated generation request: what to pass to `stream_generate` and how to answer. `n` choices, each
    run from its own `choices` entry (prepare fills them; the first is `kwargs`); `echo`: a completion's text
    starts with its prompt (`prompt_text`), whose ids prepare keeps (`prompt_ids`, <bos> first)."""

    def __init__(
        self,
        kind: str,
        kwargs: dict,
        stream: bool,
        include_usage: bool,
        logprobs: int | None,
        n: int = 1,
        echo: bool = False,
    ):
        self.kind, self.kwargs, self.stream = kind, kwargs, stream
        self.include_usage, self.logprobs = include_usage, logprobs
        self.n, self.echo = n, echo
        self.choices = [kwargs]
        self.prompts = [kwargs.get("prompt")]  # a completion's batch: n choices each, in order
        self.prompt_tokens = 0
        self.prompt_ids: list[int] = []
        self.prompt_text = ""  # what echo repeats
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


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index`: the request's for the first, the next ones after it (wrapping within the
    signed 64-bit range), so a seeded request with n > 1 reproduces every choice; None stays None."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


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
    n, echo = _n(body), _field(body, "echo", bool, False) if kind == "completion" else False
    options = _field(body, "stream_options", dict, {})
    include_usage = _field(options, "include_usage", bool, False)
    # the sampling fields as declared (logprobs, whose shape differs by endpoint, below)
    sampling = {
        f.name: _field(body, f.name, NUMBER if f.kind is float else f.kind) for f in FIELDS if f.name != "logprobs"
    }
    kwargs = {"stop": _stop(body)}
    if kind == "chat":
        kwargs["messages"] = _messages(body, model, limits, fetched or {})
        kwargs["enable_thinking"] = _thinking(body)
        kwargs.update(_tooling(body, model, kwargs["enable_thinking"]))
        want = _field(body, "logprobs", bool, False)
        top = _field(body, "top_logprobs", int)
        if top is not None and not want:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
        logprobs = (top or 0) if want else None
        kwargs["max_tokens"] = _max_tokens(body, ("max_completion_tokens", "max_tokens"), model.context)
        lp_param = "top_logprobs"
    else:
        prompts = _prompts(body, model)
        if echo and len(prompts) > 1:
            raise APIError(400, f"echo: one prompt a request (a batch of {len(prompts)} was given)", param="echo")
        kwargs.update(prompt=prompts[0], raw=True)
        logprobs = _field(body, "logprobs", int)
        # with echo, max_tokens=0 asks for the prompt alone (its logprobs: what a loglikelihood evaluation reads)
        kwargs["max_tokens"] = _max_tokens(body, ("max_tokens",), 16, least=0 if echo else 1)  # the API's default
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
    if echo and logprobs is not None and not hasattr(model, "prompt_logprobs"):
        raise APIError(400, "echo: this model cannot report its prompt's logprobs", param="echo")
    req = Request(kind, kwargs, stream, include_usage, logprobs, n, echo)
    if kind == "completion":
        req.prompts, req.n = prompts, n * len(prompts)
        if echo and not isinstance(prompts[0], str):  # a prompt of ids is echoed whole, as its tokens' text
            req.prompt_text, req.echo_from = model.tokenizer.decode(prompts[0], skip_special_tokens=False), 0
        elif echo:
            req.prompt_text = prompts[0]
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
        # a batch's prompt k runs choices k*per .. k*per+per-1, seeded as one prompt's n choices are
        per = req.n // len(req.prompts)
        req.choices = [req.kwargs] + [
            _choice(build, {**kw, "prompt": req.prompts[i // per]} if i >= per else kw, i % per)
            for i in range(1, req.n)
        ]
        if build is not None and len(req.prompts) > 1:  # every prompt counted and checked, once each
            lengths = [c["request"].ids for c in req.choices[::per]]
            ids = max(lengths, key=len)
            req.prompt_tokens = sum(map(len, lengths))
    except ChatError as e:
        raise APIError(400, str(e), param=e.param or param) from None  # TooDeep names the field; error_of agrees
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
    req.prompt_tokens = req.prompt_tokens if len(req.prompts) > 1 else len(ids)
    req.prompt_ids = list(ids) if req.echo else []  # a raw prompt: <bos>, then the text's ids; or the ids given


def _choice(build, kw: dict, index: int) -> dict:
    """The arguments of choice `index` > 0: the first's with the seed derived for it, prepared on its own (a
    prepared request is used once: its grammar's state follows one output)."""
    kw = {**kw, "seed": choice_seed(kw.get("seed"), index)}
    return kw if build is None else {"request": build(**kw)}
