"""Gemma 4's format in one module: the roles and turns of its prompt (the built-in formatter, for bundles without a
chat template), and its function-calling syntax, written (declarations, call arguments, as the template's macros
write them), parsed (a call the model wrote, back into JSON) and spelled for the grammar (GEMMA_VALUES). The
control tokens' ids are in tokens.py; the chat template (tests/fixtures/gemma4_chat_template.jinja) is the
authority every piece here is tested against.

The syntax: a declaration is `declaration:NAME{description:<|"|>...<|"|>,parameters:{...}}`, a call
`call:NAME{key:value,...}` with bare keys, strings between <|"|> delimiters, numbers, true/false/null and nested
{...} and [...], as the template's format_argument writes them.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from typing import NoReturn

from ..errors import InputError
from .tokens import STRING_DELIM

Q = '<|"|>'  # the string delimiter, one token (tokens.STRING_DELIM)
NAME = re.compile(r"[\w.:-]+")  # a function name: it must end where the call's arguments begin
STANDARD_KEYS = ("description", "type", "properties", "required", "nullable")

# the turn each role opens; "tool" messages open none: they are answers to the calls before them
ROLES = {
    "system": "system",
    "developer": "developer",
    "user": "user",
    "assistant": "model",
    "model": "model",
    "tool": "tool",
}


class ChatError(InputError):
    """A conversation or template that cannot be rendered; the message says why."""


# Gemma's values, as the template's format_argument writes them (escape_keys=False): no whitespace, keys
# bare, strings between <|"|> tokens. (Excluding the text <|"|> from strings, as the template cannot write
# it either, makes llguidance walk the whole vocabulary: 6-15 ms a token instead of 0.1 ms.)
GEMMA_VALUES = f"""
g_value: g_string | G_NUMBER | "true" | "false" | "null" | g_object | g_array
g_string: <[{STRING_DELIM}]> G_TEXT? <[{STRING_DELIM}]>
g_object: "{{" (g_pair ("," g_pair)*)? "}}"
g_pair: G_KEY ":" g_value
g_array: "[" (g_value ("," g_value)*)? "]"
G_TEXT: /(?s:.+)/
G_KEY: /[^\\s:{{}}\\[\\],]{{1,64}}/
G_INT: /-?(0|[1-9][0-9]{{0,15}})/
G_NUMBER: /-?(0|[1-9][0-9]{{0,15}})(\\.[0-9]{{1,16}})?([eE][-+]?[0-9]{{1,3}})?/
"""


# -- writing: the template's macros in Python ----------------------------------------------------------


def _dictsort(d: Mapping) -> list:
    """jinja's dictsort: by key, strings compared lowercased."""
    return sorted(d.items(), key=lambda kv: kv[0].lower() if isinstance(kv[0], str) else kv[0])


def gemma_value(value, escape_keys: bool = False) -> str:
    """The template's format_argument: a JSON value as Gemma writes it."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        key = (lambda k: Q + k + Q) if escape_keys else str
        return "{" + ",".join(f"{key(k)}:{gemma_value(v, escape_keys)}" for k, v in _dictsort(value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(gemma_value(v, escape_keys) for v in value) + "]"
    return str(value)  # numbers, as jinja prints them


def _upper(schema, key: str) -> str:
    """`schema[key] | upper` in jinja: a missing item (or an item of a non-mapping) is undefined, printed ''."""
    return str(schema[key]).upper() if isinstance(schema, Mapping) and key in schema else ""


def _quoted(items) -> str:
    return ",".join(f"{Q}{x}{Q}" for x in items)


def _properties(properties: Mapping, filter_keys: bool = False) -> str:
    """The template's format_parameters: each property's schema, keys sorted."""
    out = []
    for key, value in _dictsort(properties):
        if filter_keys and key in STANDARD_KEYS:
            continue
        get = value.get if isinstance(value, Mapping) else lambda k: None
        kind, fields = _upper(value, "type"), []
        if get("description"):
            fields.append(f"description:{Q}{value['description']}{Q}")
        if kind == "STRING" and get("enum"):
            fields.append("enum:" + gemma_value(value["enum"], escape_keys=True))
        elif kind == "ARRAY" and isinstance(get("items"), Mapping) and value["items"]:
            fields.append("items:{" + _items(value["items"]) + "}")
        if get("nullable"):
            fields.append("nullable:true")
        if kind == "OBJECT":
            # without "properties", the schema's own non-standard keys (additionalProperties, ...) stand for them
            nested = get("properties")
            inner = _properties(nested) if isinstance(nested, Mapping) else _properties(value, filter_keys=True)
            fields.append("properties:{" + inner + "}")
            if get("required"):
                fields.append(f"required:[{_quoted(value['required'])}]")
        fields.append(f"type:{Q}{kind}{Q}")
        out.append(f"{key}:{{{','.join(fields)}}}")
    return ",".join(out)


def _items(items: Mapping) -> str:
    """An array's `items` schema, as format_parameters writes it."""
    out = []
    for key, value in _dictsort(items):
        if value is None:
            continue
        if key == "properties":
            out.append("properties:{" + (_properties(value) if isinstance(value, Mapping) else "") + "}")
        elif key == "required":
            out.append(f"required:[{_quoted(value)}]")
        elif key == "type":
            kind = value.upper() if isinstance(value, str) else [str(t).upper() for t in value]
            out.append("type:" + gemma_value(kind, escape_keys=True))
        else:
            out.append(f"{key}:{gemma_value(value, escape_keys=True)}")
    return ",".join(out)


def declaration(tool: dict) -> str:
    """The template's format_function_declaration: what goes between <|tool> and <tool|>."""
    f = tool["function"]
    out = f"declaration:{f['name']}{{description:{Q}{f.get('description', '')}{Q}"
    params = f.get("parameters")
    if params:
        out += ",parameters:{"
        if params.get("properties"):
            out += "properties:{" + _properties(params["properties"]) + "},"
        if params.get("required"):
            out += f"required:[{_quoted(params['required'])}],"
        if params.get("type"):
            out += f"type:{Q}{_upper(params, 'type')}{Q}}}"  # the template closes parameters only here
    if "response" in f:
        response = f["response"]
        out += ",response:{"
        if isinstance(response, Mapping) and response.get("description"):
            out += f"description:{Q}{response['description']}{Q},"
        if _upper(response, "type") == "OBJECT":
            out += f"type:{Q}OBJECT{Q}}}"
    return (out + "}").strip()


# -- reading: a call the model wrote ----------------------------------------------------------------


_CALL = re.compile(r"call:(" + NAME.pattern + r")(?=\{)")
_BARE_KEY = re.compile(r"[^:{}\[\],]+")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None}


def parse_call(text: str) -> tuple[str, dict]:
    """(name, arguments) of `call:NAME{key:value,...}`, the text between <|tool_call> and <tool_call|>;
    a ValueError saying what is wrong where if it is not one."""
    m = _CALL.match(text)
    if not m:
        raise ValueError(f"expected call:NAME{{...}}, got {text[:40]!r}")
    try:
        arguments, end = _object(text, m.end())
    except RecursionError:
        raise ValueError("arguments nested too deeply") from None
    if end != len(text):
        raise ValueError(f"text after the arguments: {text[end : end + 20]!r}")
    return m.group(1), arguments


def _fail(text: str, i: int, want: str) -> NoReturn:
    found = repr(text[i : i + 20]) if i < len(text) else "the end"
    raise ValueError(f"expected {want} at character {i}, found {found}")


def _object(text: str, i: int) -> tuple[dict, int]:
    out, i = {}, i + 1  # past "{"
    if text.startswith("}", i):
        return out, i + 1
    while True:
        if text.startswith(Q, i):  # a quoted key, as format_argument writes them with escape_keys
            key, i = _string(text, i)
        elif m := _BARE_KEY.match(text, i):
            key, i = m.group(), m.end()
        else:
            _fail(text, i, "a key")
        if not text.startswith(":", i):
            _fail(text, i, "':'")
        out[key], i = _value(text, i + 1)
        if text.startswith("}", i):
            return out, i + 1
        if not text.startswith(",", i):
            _fail(text, i, "',' or '}'")
        i += 1


def _array(text: str, i: int) -> tuple[list, int]:
    out, i = [], i + 1  # past "["
    if text.startswith("]", i):
        return out, i + 1
    while True:
        value, i = _value(text, i)
        out.append(value)
        if text.startswith("]", i):
            return out, i + 1
        if not text.startswith(",", i):
            _fail(text, i, "',' or ']'")
        i += 1


def _string(text: str, i: int) -> tuple[str, int]:
    end = text.find(Q, i + len(Q))
    if end < 0:
        raise ValueError(f"the string at character {i} is never closed")
    return text[i + len(Q) : end], end + len(Q)


def _value(text: str, i: int):
    if text.startswith(Q, i):
        return _string(text, i)
    if text.startswith("{", i):
        return _object(text, i)
    if text.startswith("[", i):
        return _array(text, i)
    for word, value in _WORDS.items():
        if text.startswith(word, i):
            return value, i + len(word)
    if m := _NUMBER.match(text, i):
        number = float(m.group()) if any(c in m.group() for c in ".eE") else int(m.group())
        if not math.isfinite(number):  # 1e999: no JSON number
            _fail(text, i, "a finite number")
        return number, m.end()
    _fail(text, i, "a value")


# -- the built-in formatter -------------------------------------------------------------------------


IMAGE_PLACEHOLDER = "<|image|>"  # what the template renders for an image part; the runtime expands it (encoder.py)
AUDIO_PLACEHOLDER = "<|audio|>"  # and for an audio part (Gemma 4's template: `audio` and `input_audio` parts)


def _parts(message: dict, images: bool = True) -> list[str]:
    """The content's parts as the template renders them: text, and the placeholder for each image or audio part
    (system turns and tool results: text only)."""
    content = message.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    parts = []
    for p in content if isinstance(content, list) else [None]:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            parts.append(p["text"])
        elif kind in ("image", "image_url"):
            parts += [IMAGE_PLACEHOLDER] if images else []
        elif kind in ("audio", "input_audio"):
            parts += [AUDIO_PLACEHOLDER] if images else []
        else:
            raise ChatError("message content must be a string or a list of text, image and audio parts")
    return parts


def _strip_thinking(text: str) -> str:
    """The template's strip_thinking: a model turn loses every <|channel>...<channel|> block (an unclosed one
    runs to the end of its part)."""
    return "".join(part.split("<|channel>")[0] for part in text.split("<channel|>")).strip()


def _call(call: dict) -> str:
    f = call["function"]
    arguments = f.get("arguments", "")  # the template refuses a missing one as it refuses a string
    if arguments is not None and not isinstance(arguments, Mapping):
        raise ChatError("tool_calls[].function.arguments must be a JSON object (mapping), not a string")
    return f"<|tool_call>call:{f['name']}{gemma_value(arguments or {})}<tool_call|>"


def _response(name: str, body) -> str:
    value = gemma_value(body) if isinstance(body, Mapping) else "{value:" + gemma_value(body) + "}"
    return f"<|tool_response>response:{name}{value}<tool_response|>"


def _responses(message: dict, following: list[dict]) -> list[str]:
    """The results answering `message`'s calls: its own tool_responses (Gemma's form), or else the role "tool"
    messages right after it (OpenAI's), each named by the call its tool_call_id points at."""
    if message.get("tool_responses"):
        return [_response(r.get("name") or "unknown", r.get("response")) for r in message["tool_responses"]]
    if not message.get("tool_calls"):
        return []
    out = []
    for m in itertools.takewhile(lambda t: t["role"] == "tool", following):
        name = m.get("name") or "unknown"
        for call in message["tool_calls"]:  # the last match wins, as in the template
            if call.get("id") == m.get("tool_call_id"):
                name = call["function"]["name"]
        body = m.get("content")
        out.append(_response(name, "".join(_parts(m, images=False)) if isinstance(body, list) else body))
    return out


def gemma4_prompt(
    messages: list[dict],
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    bos_token: str = "<bos>",
    tools: list[dict] | None = None,
) -> str:
    """The built-in Gemma 4 formatter, for bundles that carry no template: what google/gemma-4-E2B-it's own
    chat template renders for a text-only conversation, tools, calls and results included (tests/test_chat.py
    and tests/test_tools.py hold the two equal)."""
    for m in messages:
        if m.get("role") not in ROLES:
            raise ChatError(f"unknown role {m.get('role')!r}: expected one of {', '.join(ROLES)}")
    out = [bos_token]
    system = messages[0] if messages and messages[0]["role"] in ("system", "developer") else None
    if system or enable_thinking or tools:  # thinking is switched on by <|think|> opening a system turn
        sep = " " if system and isinstance(system.get("content"), list) else ""  # the template's quirk
        text = "".join(p.strip() + sep for p in _parts(system, images=False)) if system else ""
        out.append("<|turn>system\n" + ("<|think|>\n" if enable_thinking else "") + text)
        out += [f"<|tool>{declaration(t)}<tool|>" for t in tools or []]
        out.append("<turn|>\n")
    turns = messages[1:] if system else messages
    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    ended, previous = None, None  # what the last message ended in ("calls", "results"); the last non-tool role
    for i, m in enumerate(turns):
        if m["role"] == "tool":
            continue  # rendered with the calls it answers (or, answering none, dropped)
        role, calls, responses = ROLES[m["role"]], m.get("tool_calls"), _responses(m, turns[i + 1 :])
        # Consecutive assistant messages are one model turn (tool results between them included).
        if not (role == "model" and previous == "assistant"):
            out.append(f"<|turn>{role}\n")
        thought = m.get("reasoning") or m.get("reasoning_content")
        if thought and i > last_user:  # reasoning from before the last user turn is not replayed
            out.append(f"<|channel>thought\n{thought}\n<channel|>")
        out += [_call(c) for c in calls or []] + responses
        ended = "results" if responses else "calls" if calls else None
        text = "".join(_strip_thinking(p) if role == "model" else p.strip() for p in _parts(m))
        out.append(text)
        after = next((t["role"] for t in turns[i + 1 :] if t["role"] != "tool"), None)
        if ended == "calls":
            out.append("<|tool_response>")  # unanswered calls: the results come next, in this turn
        elif not ((role == "model" and after == "assistant") or (responses and not text.strip() and after is None)):
            out.append("<turn|>\n")  # (results that end the conversation leave the turn open for the answer)
        previous = m["role"]
    if add_generation_prompt and ended is None:
        out.append("<|turn>model\n")
    elif add_generation_prompt and ended == "results" and enable_thinking:
        out.append("<|channel>thought\n")
    return "".join(out)
