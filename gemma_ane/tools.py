"""Function calling in Gemma 4's own syntax: checking OpenAI-style tools, writing their declarations and
arguments as the chat template does, and reading a call the model wrote back into JSON.

The syntax (tests/fixtures/gemma4_chat_template.jinja is the authority): a declaration is
`declaration:NAME{description:<|"|>...<|"|>,parameters:{...}}`, a call `call:NAME{key:value,...}` with bare
keys, strings between <|"|> delimiters, numbers, true/false/null and nested {...} and [...], as the
template's format_argument writes them.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from .errors import InputError

Q = '<|"|>'  # the string delimiter, one token (tokens.STRING_DELIM)
NAME = re.compile(r"[\w.:-]+")  # a function name: it must end where the call's arguments begin
STANDARD_KEYS = ("description", "type", "properties", "required", "nullable")
# How deep a client's JSON (a tool's parameters, a call's arguments, a response format's schema, a message's
# content) may nest. The template, the escaping and the grammar's rules walk it a Python frame or more a level:
# a few thousand brackets would exhaust the stack (RecursionError, not the client's error) long before any
# schema or argument a model is asked to follow gets that deep.
MAX_DEPTH = 64


class ToolError(InputError):
    """A tool definition or tool call that cannot be used; `param` is the field's path in the request."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param = param


# -- checking what a client sends --------------------------------------------------------------------


def too_deep(value, limit: int = MAX_DEPTH) -> bool:
    """Does `value` (dicts, lists and tuples of values) nest containers more than `limit` deep? Found a level
    at a time, without recursion, so any depth is measured."""
    level = [value]
    for _ in range(limit + 1):
        level = [
            item
            for x in level
            for item in (x.values() if isinstance(x, Mapping) else x if isinstance(x, (list, tuple)) else ())
        ]
        if not level:
            return False
    return True


def _check_name(name, where: str) -> str:
    """A function's name, as the template prints it: bare, between control tokens, so nothing but a name."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(where, f"expected a name of letters, digits, _ . : -, got {name!r}")
    return name


def check_depth(fields: Mapping, where: str) -> None:
    """A ToolError naming the first of `fields` (an object's fields, at `where`) nested more than MAX_DEPTH deep."""
    for key, value in fields.items():
        if too_deep(value):
            raise ToolError(f"{where}.{key}", f"nested more than {MAX_DEPTH} deep")


def check_tools(tools) -> list[dict]:
    """OpenAI-style tools, checked field by field; returned as given but without null optional fields
    (the template would print a null description as "None")."""
    if not isinstance(tools, list):
        raise ToolError("tools", "expected an array of tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolError(where, "expected an object")
        if tool.get("type") != "function":
            raise ToolError(f"{where}.type", f"expected 'function', got {tool.get('type')!r}")
        f = tool.get("function")
        if not isinstance(f, dict):
            raise ToolError(f"{where}.function", "expected an object")
        f = {k: v for k, v in f.items() if v is not None}
        name = _check_name(f.get("name"), f"{where}.function.name")
        if name in seen:
            raise ToolError(f"{where}.function.name", f"{name!r} is defined twice")
        seen.add(name)
        if not isinstance(f.get("description", ""), str):
            raise ToolError(f"{where}.function.description", "expected a string")
        params = f.get("parameters", {})
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters", "expected a JSON schema object")
        if not isinstance(params.get("properties", {}), dict):
            raise ToolError(f"{where}.function.parameters.properties", "expected an object")
        check_depth(f, f"{where}.function")
        check_depth({k: v for k, v in tool.items() if k != "function"}, where)
        out.append({**tool, "function": f})
    return out


def prepare_messages(messages: list) -> list:
    """`messages` with each tool call's JSON-string `arguments` (as OpenAI clients send them) parsed into
    the mapping the template requires, each call's name checked as a declaration's is (the template prints
    it bare, between control tokens) and its fields' nesting bounded; copies, the caller's messages stay as
    they are."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        # a result's function name is printed bare too: a tool message's own, or a Gemma-style tool_responses'
        if isinstance(m, dict) and m.get("role") == "tool" and m.get("name") is not None:
            _check_name(m["name"], f"messages[{i}].name")
        responses = m.get("tool_responses") if isinstance(m, dict) else None
        for k, r in enumerate(responses if isinstance(responses, list) else []):
            if isinstance(r, dict) and r.get("name") is not None:
                _check_name(r["name"], f"messages[{i}].tool_responses[{k}].name")
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_parsed(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]}
        out.append(m)
    return out


def _parsed(call, where: str):
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict):
        return call
    _check_name(f.get("name"), f"{where}.function.name")
    check_depth({k: v for k, v in call.items() if k != "function"}, where)
    check_depth(f, f"{where}.function")
    if not isinstance(f.get("arguments"), str):
        return call
    where += ".function.arguments"
    try:
        arguments = json.loads(f["arguments"])
    except ValueError as e:
        raise ToolError(where, f"not valid JSON ({e})") from None
    except RecursionError:  # the decoder recurses a level at a time: some thousand levels exhaust the stack
        raise ToolError(where, f"nested more than {MAX_DEPTH} deep") from None
    if not isinstance(arguments, dict):
        raise ToolError(where, f"expected a JSON object, got {type(arguments).__name__}")
    if too_deep(arguments):
        raise ToolError(where, f"nested more than {MAX_DEPTH} deep")
    return {**call, "function": {**f, "arguments": arguments}}


def check_tool_choice(choice, tools) -> str:
    """'auto', 'none', 'required' or a function's name, from the Python or the OpenAI spelling."""
    expected = "expected 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
    if isinstance(choice, dict):  # OpenAI's {"type": "function", "function": {"name": ...}}
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError("tool_choice", expected)
        choice = name
    if not isinstance(choice, str):
        raise ToolError("tool_choice", f"{choice!r}: {expected}")
    if choice not in ("auto", "none") and not tools:
        raise ToolError("tool_choice", f"{choice!r} but no tools were given")
    if choice not in ("auto", "none", "required") and choice not in {t["function"]["name"] for t in tools}:
        raise ToolError("tool_choice", f"no tool is named {choice!r}")
    return choice


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


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict

    def to_openai(self) -> dict:
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
