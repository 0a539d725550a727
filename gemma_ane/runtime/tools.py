"""Function calling: checking the OpenAI-style tools, tool choice and calls a client sends (ToolError naming the
field), and the ToolCall the runtime returns. Gemma 4's syntax itself, written and parsed, is gemma4.py's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InputError

# Gemma's call syntax lives in gemma4.py; these names were imported from here before it, and still are
from .gemma4 import NAME, declaration, gemma_value, parse_call  # noqa: F401

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
    if not f["arguments"].strip():  # a call without arguments, as some clients store it (vLLM reads it as {})
        return {**call, "function": {**f, "arguments": {}}}
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


def parallel_calls(choice: str, parallel: bool) -> bool:
    """Whether a turn may make more than one call. A named choice forces one call of that function (OpenAI's
    wording; vLLM returns exactly one): called again and again, a caller that loops over tool_calls would run it
    as often, and the turn would end on the token limit. "required" and "auto" follow parallel_tool_calls."""
    return parallel and choice in ("auto", "none", "required")


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
