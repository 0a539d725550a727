"""Prompts in, text out: the chat template, streaming detokenisation, thinking, tool calls and stop strings.
(Gemma 4's own format, the built-in formatter for bundles without a template included, is gemma4.py's.)

A bundle is a downloaded file, so its chat template is untrusted code: it is rendered in jinja2's
ImmutableSandboxedEnvironment, which refuses attribute access to Python internals, bounded in work
as well (see _Sandbox): a template cannot hold a CPU or fill the memory.
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, MappingView, Set
from dataclasses import dataclass, field

from jinja2 import TemplateError, nodes
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from .gemma4 import ChatError, gemma4_prompt
from .tokens import CHANNEL_CLOSE, CHANNEL_OPEN, SPECIAL_TOKENS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from .tools import MAX_DEPTH, ToolCall, call_id, parse_call, too_deep

# -- the sandbox, bounded in work ------------------------------------------------------------------
# jinja2's sandbox keeps a template from Python's internals, not from looping for hours or building a
# gigabyte. Here every operator, call, attribute, filter and loop step checks the render's deadline
# (Python cannot stop a thread, so the template must stop itself), and no value the template builds
# may stand for more than MAX_TEXT characters: checked before the operations whose result is a product
# of their inputs (repetition, powers, formatting, replace, join, indent), after the others, and on
# literals. So printing, comparing or hashing any value is bounded work, one step from a deadline check.

# Google's Gemma 4 template takes time quadratic in the turns: ~1.5 s for the 400 short turns a 2048-token
# context can hold, on a busy 2-core machine; 0.1 s for 100.
RENDER_SECONDS = 5.0
MAX_TEXT = 4_000_000  # characters: of the prompt, and of what any value built while rendering stands for
MAX_INT_BITS = 4096  # numbers the template computes stay small enough for arithmetic to be instant


class _Deadline(threading.local):
    at = math.inf  # when the render under way in this thread must end


_deadline = _Deadline()


def _tick() -> None:
    if time.monotonic() > _deadline.at:
        raise ChatError(f"chat template: rendering takes more than {RENDER_SECONDS:g} s (a loop without end?)")


def _fits(size: int, what: str) -> None:
    if size > MAX_TEXT:
        raise ChatError(f"chat template: {what} would exceed {MAX_TEXT:,} characters or items")


def _size(value) -> int:
    """About how many characters str(value) has, counted until MAX_TEXT is passed. A container counts
    an item once per reference: a list of ten references to a list of ten references to ... is as big
    as it prints."""
    total, todo = 0, [value]
    while todo and total <= MAX_TEXT:
        x = todo.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, int):
            total += x.bit_length() // 3 + 1
        elif isinstance(x, float) or x is None:
            total += 8
        elif isinstance(x, (list, tuple, dict)) or isinstance(x, (Mapping, Set, MappingView)):  # ABCs: slower
            total += 2 + 2 * len(x)
            if total <= MAX_TEXT:
                todo.extend(x.items() if isinstance(x, Mapping) else x)
        elif isinstance(x, Namespace):
            todo.append(object.__getattribute__(x, "_Namespace__attrs"))
        else:
            total += 8  # a macro, a loop: a short repr
    return total


def _made(value, *inputs):
    """`value`, which the template built, if it is not too big (one of the inputs is known already)."""
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ChatError(f"chat template: a number would exceed {MAX_INT_BITS} bits")
    if not any(value is x for x in inputs):
        _fits(_size(value), "a value")
    return value


def _check_numbers(name: str, values) -> None:
    """Numbers given to a function or filter are widths and counts: center(10**9) is refused up front."""
    for v in values:
        if type(v) is int and abs(v) > MAX_TEXT:
            raise ChatError(f"chat template: {name} was given {v}, more than {MAX_TEXT:,}")


def _format_size(fmt, values) -> int:
    """At most what `fmt % values` or `fmt.format(*values)` builds: each field as long as the longest value
    (a field may repeat one) plus its spec's numbers (width, precision); the values count as widths too
    where the format takes widths from them (`*`, a nested `{}`)."""
    fmt = fmt if isinstance(fmt, str) else str(fmt)
    longest = max((_size(v) for v in values), default=0)
    if re.search(r"\*|\{[^{}]*\{", fmt):
        longest += max((abs(v) for v in values if type(v) is int), default=0)
    fields = re.findall(r"%[^a-zA-Z%]*[a-zA-Z%]|\{[^{}]*\}", fmt)
    return len(fmt) + sum(longest + sum(map(int, re.findall(r"\d+", f))) for f in fields)


def _values(args) -> list:
    """The values `fmt % args` formats."""
    return list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]


def _replace_size(s, old, new, count=None) -> int:
    n = s.count(old) if isinstance(s, str) and isinstance(old, str) and old else _size(s) + 1
    if count is not None and count >= 0:
        n = min(n, count)
    return _size(s) + n * _size(new)


def _join_size(items, sep="", attribute=None) -> int:
    return sum(map(_size, items)) + _size(sep) * len(items)


def _indent_size(s, width=4, first=False, blank=False) -> int:
    lines = s.count("\n") + 1 if isinstance(s, str) else _size(s) + 1
    return _size(s) + lines * (width if type(width) is int else _size(width))


def _wordwrap_size(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True) -> int:
    return _size(s) + (_size(s) + 1) * _size(wrapstring or "\n")


# What a filter or str method would build, for those whose result can outgrow their inputs' sum; their
# arguments as the filter or method takes them (a filter's value first, a method's string first).
_FILTER_SIZES = {
    "replace": _replace_size,
    "join": _join_size,
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "format": lambda value, *args, **kwargs: _format_size(value, [*args, *kwargs.values()]),
    # sum(start=[]) copies the growing list at each item: quadratic work in one uninterruptible call
    "sum": lambda items, attribute=None, start=0: len(items) ** 2 if isinstance(start, (list, tuple)) else 0,
}
_METHOD_SIZES = {
    "replace": _replace_size,
    "join": lambda s, items: _join_size(items, s),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * tabsize,
    "translate": lambda s, table: len(s) * max([1, *map(_size, table.values())] if isinstance(table, Mapping) else [1]),
    "format": lambda s, *args, **kwargs: _format_size(s, [*args, *kwargs.values()]),
    "format_map": lambda s, mapping: _format_size(s, _values(mapping)),
}


def _materialized(args) -> list:
    """Generators (a `map` filter's result) made lists, so their items can be sized before use."""
    return [list(a) if isinstance(a, Iterator) else a for a in args]


def _bounded_filter(name: str, f):
    first = 1 if hasattr(f, "jinja_pass_arg") else 0  # a context, eval context or environment comes first
    size = _FILTER_SIZES.get(name)

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _tick()
        args = _materialized(args)
        _check_numbers(name, [*args[first + 1 :], *kwargs.values()])
        if size:
            _fits(size(*args[first:], **kwargs), f"the {name} filter's result")
        return _made(f(*args, **kwargs), *args)

    return bounded


def _steps(iterable):
    """A loop's items, with the deadline checked at each: nested loops end on time."""
    for item in iterable:
        _tick()
        yield item


def _raise_exception(message):
    raise TemplateError(message)


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(ImmutableSandboxedEnvironment.default_binop_table)

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        del self.globals["lipsum"]  # lorem ipsum, generated where no deadline is checked
        del self.filters["urlize"]  # seconds per megabyte in one call; no chat template links URLs
        self.globals["raise_exception"] = _raise_exception
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters.update(_steps=_steps, _built=_made)  # used by _Bounds

    def call_binop(self, context, operator, left, right):
        _tick()
        if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
            _fits(_size(right) * left, "a repetition")
        if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
            _fits(_size(left) * right, "a repetition")
        if operator == "**" and type(left) is int and type(right) is int and left.bit_length() * right > MAX_INT_BITS:
            raise ChatError(f"chat template: a power would exceed {MAX_INT_BITS} bits")
        if operator == "%" and isinstance(left, str):
            _fits(_format_size(left, _values(right)), "a formatted string")
        return _made(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's names: kwargs may be "self")
        _tick()
        args = _materialized(args)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox hands out str.format wrapped
        name = getattr(method, "__name__", "a function")
        if not isinstance(__obj, Macro):  # a macro takes data (a tool call's id: 12345678901); what it calls is checked
            _check_numbers(name, [*args, *kwargs.values()])
        size = _METHOD_SIZES.get(name) if isinstance(getattr(method, "__self__", None), str) else None
        if size:
            _fits(size(method.__self__, *args, **kwargs), f"str.{name}'s result")
        return _made(super().call(__context, __obj, *args, **kwargs), *args)

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)

    def concat(self, pieces):  # the text of a {% set %} block, a macro or a caller(), sized before it is joined
        pieces = list(pieces)
        _tick()
        _fits(sum(map(len, pieces)), "a block's text")
        return "".join(pieces)


def _filtered(node, name: str):
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


class _Bounds(NodeTransformer):
    """Rewrites a parsed template: loops check the deadline at each step (_steps), and list, tuple and dict
    literals and `~` are sized where they are built (_built), which the sandbox has no hook for."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = _filtered(node.iter, "_steps")
        return node

    def visit_List(self, node):
        return _filtered(self.generic_visit(node), "_built")

    visit_Dict = visit_Concat = visit_List

    def visit_Tuple(self, node):
        node = self.generic_visit(node)
        return _filtered(node, "_built") if node.ctx == "load" else node  # not a target: {% for k, v in ... %}


def _one_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:300]


# -- text for the tokenizer --------------------------------------------------------------------------


class InvalidText(ChatError):
    """A string no tokenizer takes: it holds a lone surrogate."""


TEXT_ROLES = ("user", "tool")  # whose content is someone's text, never control tokens (see ControlTokens)
# Unicode's noncharacters, kept for a program's internal use: a mark that no text should hold
_MARKS = [chr(c) for c in range(0xFDD0, 0xFDF0)] + [chr(p << 16 | 0xFFFE | k) for p in range(17) for k in (0, 1)]
_MARK_SET = frozenset(_MARKS)


def _strings(value, where: str):
    """(where, string) for every string in `value`: a str, or messages (dicts and lists, keys included)."""
    todo = [(where, value)]
    while todo:
        where, x = todo.pop()
        if isinstance(x, str):
            yield where, x
        elif isinstance(x, dict):
            for k, v in x.items():
                path = f"{where}.{k}" if isinstance(k, str) and k.isidentifier() else f"{where}[{ascii(k)}]"
                todo += [(f"{where} (a key)", k), (path, v)]
        elif isinstance(x, (list, tuple)):
            todo += [(f"{where}[{i}]", v) for i, v in enumerate(x)]


def check_text(value, where: str) -> None:
    """Refuses a string holding a lone surrogate, which no tokenizer takes: what undecodable bytes become
    in argv or a surrogateescape'd stdin, or what a JSON "\\ud800" decodes to."""
    for path, text in _strings(value, where):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidText(
                f"{path}: not valid text (a lone surrogate U+{ord(text[e.start]):04X} at character {e.start};"
                " is the input UTF-8?)"
            ) from None


def unused_mark(*values) -> str:
    """A character that no string in `values` (text, messages) holds."""
    used = set().union(*(_MARK_SET.intersection(text) for value in values for _, text in _strings(value, "")))
    for mark in _MARKS:
        if mark not in used:
            return mark
    raise ChatError("the messages hold every Unicode noncharacter (U+FDD0..U+FDEF, U+FFFE, U+FFFF, ...)")


class TooDeep(ChatError):
    """A message's field nested more than tools.MAX_DEPTH deep; `param` is its path."""

    def __init__(self, param: str):
        super().__init__(f"{param}: nested more than {MAX_DEPTH} deep")
        self.param = param


def check_nesting(messages) -> None:
    """Refuses a message whose fields nest deeper than MAX_DEPTH, before escape_strings and the template walk
    them a Python frame or more a level. Tool calls are tools.prepare_messages' to check (their arguments may
    still be a JSON string here)."""
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        for key, value in m.items() if isinstance(m, dict) else ():
            if key != "tool_calls" and too_deep(value):
                raise TooDeep(f"messages[{i}].{key}")


def escape_strings(value, escape):
    """A copy of a JSON-like value with `escape` applied to every string in it, keys included."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {escape_strings(k, escape): escape_strings(v, escape) for k, v in value.items()}
    return [escape_strings(v, escape) for v in value] if isinstance(value, list) else value


def escape_content(messages: list, escape) -> list:
    """`messages` with `escape` applied to the text of each user and tool message, and to every string
    in the arguments of the tool calls a message carries (a client writes those; the template prints
    them bare). Copies: the caller's messages stay as they are."""

    def part(p):
        return {**p, "text": escape(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p

    def call(c):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("arguments"), dict):
            return c
        return {**c, "function": {**f, "arguments": escape_strings(f["arguments"], escape)}}

    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") in TEXT_ROLES:
            content = m.get("content")
            if isinstance(content, str):
                m = {**m, "content": escape(content)}
            elif isinstance(content, list):
                m = {**m, "content": [part(p) for p in content]}
        if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
            m = {**m, "tool_calls": [call(c) for c in m["tool_calls"]]}
        out.append(m)
    return out


_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "?"}}


def _uses_tools(messages: list, tools) -> bool:
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "<bos>", eos_token: str = "<eos>"):
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self._template = None
        if source is not None:
            env = _Sandbox()
            try:
                tree = _Bounds().visit(env.parse(source))
                tree.set_environment(env)
                self._template = env.from_string(tree)
            except (TemplateError, RecursionError) as e:
                raise ChatError(f"chat template does not compile: {_one_line(e)}") from None

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt for `messages` and `tools` (OpenAI-style, see tools.check_tools; tool calls' arguments
        as mappings, see tools.prepare_messages)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ChatError("messages must be a list of {'role', 'content'} objects")
        if self._template is None or (_uses_tools(messages, tools) and not self.renders_tools):
            return gemma4_prompt(messages, add_generation_prompt, enable_thinking, self.bos_token, tools)
        return self._render(messages, add_generation_prompt, enable_thinking, tools)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the template declares tools, as Google's does. One that does not (written before
        function calling, like `gemma-ane tiny`'s) would drop them without a word: a conversation with
        tools goes to the built-in formatter instead, which writes Google's format (said once)."""
        if self._template is None:
            return True
        probe = [{"role": "user", "content": "?"}]
        try:
            declares = "<|tool>" in self._render(probe, True, False, [_PROBE_TOOL])
        except ChatError:
            declares = False
        if not declares:
            warnings.warn(
                "the chat template does not render tools: conversations with tools use the built-in Gemma 4 format",
                stacklevel=3,
            )
        return declares

    def _render(self, messages, add_generation_prompt, enable_thinking, tools) -> str:
        context = dict(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
            documents=None,
        )
        _deadline.at = time.monotonic() + RENDER_SECONDS
        try:
            out, size = [], 0
            for piece in self._template.generate(context):
                size += len(piece)
                if size > MAX_TEXT:
                    raise ChatError(f"chat template: renders more than {MAX_TEXT:,} characters")
                _tick()
                out.append(piece)
            return "".join(out)
        except ChatError:
            raise
        except TemplateError as e:  # SecurityError included: a template reaching for internals
            raise ChatError(f"chat template failed: {_one_line(e)}") from None
        except RecursionError:  # a macro calling itself without end
            raise ChatError("chat template failed: recursion too deep") from None
        except Exception as e:  # the template's own fault: 1/0, an {% include %} of nothing, ...
            raise ChatError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None
        finally:
            _deadline.at = math.inf


class Detokenizer:
    """Incremental decoding that never emits half a multi-byte character, in O(1) per token.

    Decodes only a short window: the tokens since the last release plus the few before them, and
    emits what the new tokens add to that prefix's text (decoding a slice on its own can differ
    at its start, e.g. a dropped leading space). Text is held while it ends in U+FFFD, an
    incomplete UTF-8 sequence."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix, self.read = 0, 0  # window start; end of the released tokens

    def _decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        before = self._decode(self.tokens[self.prefix : self.read])
        text = self._decode(self.tokens[self.prefix :])
        if (text.endswith("\ufffd") and not final) or len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return text[len(before) :]


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


MAX_STOPS = 4  # stop strings in one request, as OpenAI allows
MAX_STOP_CHARS = 1000  # characters in one stop string: far above any real one, and each token's check stays cheap


class StopError(ChatError):
    """Stop strings that are refused: too many, too long, or not strings."""

    param = "stop"


def check_stop(stop) -> list[str]:
    """`stop` (None, a string or a list of strings) as a list, within MAX_STOPS strings of MAX_STOP_CHARS
    characters each; the one check the runtime and the server apply."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise StopError("stop: expected a string or an array of strings")
    if len(stops) > MAX_STOPS:
        raise StopError(f"stop: {len(stops)} strings, more than the {MAX_STOPS} allowed")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise StopError(f"{where}: {len(s)} characters, more than the limit of {MAX_STOP_CHARS}")
    return list(stops)


def _prefix_function(s: str) -> list[int]:
    """KMP's table: [k] is the length of the longest proper prefix of s[: k + 1] that is also its suffix."""
    table, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        k += s[i] == s[k]
        table[i] = k
    return table


class OutputParser:
    """Splits generated tokens into answer, reasoning (`<|channel>thought\\n ... <channel|>`) and tool calls
    (`<|tool_call>call:NAME{...}<tool_call|>`), and applies stop strings to the answer, holding back any tail
    that could still become one. A call is released once closed: as a ToolCall if it parses and names one of
    `tools` (any name when no tools are given), else as text, with a warning."""

    def __init__(self, tokenizer, stop: list[str] | None = None, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.content = Detokenizer(tokenizer)
        self.reasoning = Detokenizer(tokenizer)
        self.in_thought, self._skip_label, self._label = False, False, ""
        self.stop = list(dict.fromkeys(s for s in check_stop(stop) if s))
        # per stop string, its KMP table and how much of it the answer so far ends with: each character
        # is matched once, so holding back costs the length of the new text, not of the stop strings
        self._tables = [_prefix_function(s) for s in self.stop]
        self._matched = [0] * len(self.stop)
        self.names = None if tools is None else {t["function"]["name"] for t in tools}
        self.call: list[int] | None = None  # the tokens of the call under way, between its markers
        self.pending = ""  # answer text not yet released (could be a stop string's prefix)
        self.stopped = False
        self.text, self.reasoning_text = "", ""
        self.tool_calls: list[ToolCall] = []

    def add(self, token: int) -> Delta:
        if self.stopped:
            return Delta()
        if self.call is not None:
            if token == TOOL_CALL_CLOSE:
                return self._end_call(closed=True)
            self.call.append(token)
            return Delta()
        if token == TOOL_CALL_OPEN:
            self.call = []
            return Delta()
        if token == CHANNEL_OPEN:
            self.in_thought, self._skip_label = True, True
            return Delta()
        if token == CHANNEL_CLOSE:
            self.in_thought = False
            return Delta()
        if self.in_thought:
            piece = self.reasoning.add(token)
            if self._skip_label:  # the channel name line: "thought\n"
                self._label += piece
                if "\n" not in self._label:
                    return Delta()
                piece, self._skip_label, self._label = self._label.split("\n", 1)[1], False, ""
            self.reasoning_text += piece
            return Delta(reasoning=piece)
        return Delta(content=self._release(self.content.add(token)))

    def _end_call(self, closed: bool) -> Delta:
        # decoded whole and with special tokens: <|"|>, which delimits strings, is one
        text = self.tokenizer.decode(self.call, skip_special_tokens=False)
        self.call = None
        try:
            if not closed:
                raise ValueError("never closed")
            name, arguments = parse_call(text)
            if self.names is not None and name not in self.names:
                raise ValueError(f"unknown function {name!r}")
        except ValueError as e:
            warnings.warn(f"a malformed tool call is returned as text: {e}", stacklevel=3)
            literal = SPECIAL_TOKENS[TOOL_CALL_OPEN] + text + (SPECIAL_TOKENS[TOOL_CALL_CLOSE] if closed else "")
            return Delta(content=self._release(literal))
        call = ToolCall(call_id(), name, arguments)
        self.tool_calls.append(call)
        return Delta(tool_calls=[call])

    def _release(self, piece: str) -> str:
        self.pending += piece
        if self._advance(piece):
            for s in self.stop:
                i = self.pending.find(s)
                if i >= 0:
                    out, self.pending, self.stopped = self.pending[:i], "", True
                    self.text += out
                    return out
        # the longest tail of the answer that some stop string starts with
        hold = max(self._matched, default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        self.text += out
        return out

    def _advance(self, piece: str) -> bool:
        """Feed `piece` to each stop string's matcher; whether one of them occurs whole."""
        found = False
        for n, (s, table) in enumerate(zip(self.stop, self._tables)):
            k = self._matched[n]
            for c in piece:
                while k and c != s[k]:
                    k = table[k - 1]
                k += c == s[k]
                if k == len(s):  # found: the answer stops here, whatever follows
                    found, k = True, table[k - 1]
            self._matched[n] = k
        return found

    def finish(self) -> Delta:
        if self.stopped:
            return Delta()
        head = self._end_call(closed=False).content if self.call is not None else ""
        if self.stopped:  # by a stop string in that call's text
            return Delta(content=head)
        tail = self.pending + self.content.flush()
        self.pending = ""
        for s in self.stop:
            if s in tail:
                tail, self.stopped = tail[: tail.find(s)], True
        self.text += tail
        return Delta(content=head + tail)
