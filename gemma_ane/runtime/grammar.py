"""Structured output by constrained decoding: grammars for OpenAI's `response_format` (any JSON object, or
JSON following a schema) and for forced tool calls in Gemma 4's own call syntax, and `Constraint`, which
masks chunk_3's logits so that only tokens continuing the grammar can be drawn.

The grammar engine is llguidance, an optional dependency (the `serve` extra), imported only when a
grammar is asked for. Chosen over the other maintained libraries because:
- it has no dependencies (one abi3 wheel); xgrammar requires torch, transformers, triton and
  apache-tvm-ffi, none of which the runtime side may import;
- it parses context-free grammars (Earley, over a lexer of lazily built regex automata) and compiles
  one in 2-3 ms: outlines-core (also dependency-free) turns a schema into a regex (recursion cut at
  depth 3) and indexes it over the whole vocabulary per grammar, 51 s for "any JSON object" and 1.2 s
  for a 3-field schema over 262,144 tokens on this machine;
- a grammar is Lark text that names control tokens by id and inlines JSON schemas (`%json`), so
  Gemma's call syntax, a thinking block and a schema share one grammar;
- mask and advance cost 0.3-0.5 ms a token on average over 262,144 tokens (bench/host_overhead.py):
  within the host's 1 ms budget.

Whitespace in JSON is bounded as llama.cpp's json_schema_to_grammar bounds it (one space, or one or two
newlines and up to 20 spaces or tabs): a model that would rather write whitespace than a value cannot
run to max_tokens. Numbers in tool calls and in JSON mode (json_object) have at most 16 digits (and 16 decimals)
for the same reason.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np

from ..errors import InputError
from .gemma4 import GEMMA_VALUES
from .tokens import (
    CHANNEL_CLOSE,
    CHANNEL_OPEN,
    STRING_DELIM,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_OPEN,
    token_bytes,
)
from .tools import MAX_DEPTH, parallel_calls, too_deep

WHITESPACE = r"( |\n{1,2}[ \t]{0,20})?"

# any JSON object, as %json {"type": "object"} takes it but for its numbers: at most 16 digits, 16 decimals and a
# 3-digit exponent, as in tool calls (gemma4.GEMMA_VALUES); whitespace bounded alike (WHITESPACE)
JSON_OBJECT = r"""answer: j_object
j_value: j_object | j_array | J_STRING | J_NUMBER | "true" | "false" | "null"
j_object: "{" WS? "}" | "{" WS? j_pair (WS? "," WS? j_pair)* WS? "}"
j_pair: J_STRING WS? ":" WS? j_value
j_array: "[" WS? "]" | "[" WS? j_value (WS? "," WS? j_value)* WS? "]"
J_STRING: /"([^"\\\x00-\x1f]|\\(["\\\/bfnrt]|u[0-9a-fA-F]{4}))*"/
J_NUMBER: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][-+]?[0-9]{1,3})?/
WS: / |\n{1,2}[ \t]{0,20}/
"""
NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
THINKING = f"think: <[{CHANNEL_OPEN}]> THINK_TEXT? <[{CHANNEL_CLOSE}]>\nTHINK_TEXT: /(?s:.+)/\n"


class GrammarError(InputError):
    """A response format, tool choice or grammar that cannot be used; `param` is the request field at
    fault (None for a token the grammar refuses)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


def _lib():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output needs llguidance: pip install 'gemma-ane[serve]'") from None
    return llguidance


def _first_line(message: str) -> str:
    """llguidance's error in one line. It opens with a location and the cause, may carry a part's own error (a
    regex, its caret, then `error: why`), and ends with the grammar's source lines (`   2 | ...`): the cause, with
    the part's why when it has one (a bare "regex parse error:" says nothing)."""
    lines = message.strip().splitlines()
    cause = next((i for i, line in enumerate(lines) if re.match(r"\s*\d+ \|", line)), len(lines))
    if not cause:
        return "invalid grammar"
    head = re.sub(r"^(at )?\d+\(\d+\): ", "", lines[0].strip())
    why = next((line.strip()[7:] for line in lines[1:cause] if line.strip().startswith("error: ")), None)
    return f"{head} {why}" if why else head


def _checked(grammar: str, param: str) -> str:
    error = _lib().LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"{param}: {_first_line(error)}", param=param)
    return grammar


def _start(body: str, thinking: bool) -> str:
    return (f"start: think? {body}\n" + THINKING) if thinking else f"start: {body}\n"


# -- response_format --------------------------------------------------------------------------------


def response_grammar(response_format, *, thinking: bool = False) -> str | None:
    """The grammar for OpenAI's `response_format`: None for none or {"type": "text"}; any JSON object for
    {"type": "json_object"}; JSON following the schema for {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"?}}. A strict schema may use only keywords llguidance enforces; otherwise
    it ignores the ones it cannot. `thinking`: a thinking block may come first."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError("response_format: expected an object", param="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":  # %json would write numbers of any length: this grammar bounds them
        return _checked(_start("answer", thinking) + JSON_OBJECT, "response_format")
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format.json_schema: expected an object", param="response_format.json_schema")
        schema, strict, param = spec.get("schema"), spec.get("strict", False), "response_format.json_schema.schema"
        if not isinstance(schema, dict):
            raise GrammarError(f"{param}: expected a JSON schema object", param=param)
        if not isinstance(strict, bool):
            param = "response_format.json_schema.strict"
            raise GrammarError(f"{param}: expected true or false", param=param)
    else:
        param = "response_format.type"
        raise GrammarError(f"{param}: expected 'text', 'json_object' or 'json_schema', got {kind!r}", param=param)
    if too_deep(schema):
        raise GrammarError(f"{param}: nested more than {MAX_DEPTH} deep", param=param)
    options = {"whitespace_pattern": WHITESPACE, "lenient": not strict}
    body = json.dumps({**bounded_numbers(schema), "x-guidance": options}, ensure_ascii=False)
    return _checked(_start("answer", thinking) + f"answer: %json {body}\n", param)


# llguidance's JSON numbers are as long as the model likes: a schema's numbers get the bounds JSON mode's have
# (16 digits), where it states none of its own. Decimals can only be bounded with multipleOf, and llguidance takes
# no step finer than 1e-10 (a float's own digits): numbers of a schema have at most 10 decimals and no exponent.
MAX_INTEGER = 10**16 - 1
DECIMAL_STEP = 1e-10
_NOT_SCHEMAS = ("const", "enum", "default", "examples")  # values, not schemas: never rewritten


def bounded_numbers(schema):
    """`schema` with every node typed integer or number bounded to at most 16 digits (and a number's decimals to
    10) where it has no bound of its own on that side."""
    if isinstance(schema, list):
        return [bounded_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _NOT_SCHEMAS else bounded_numbers(v) for k, v in schema.items()}
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "integer" in types or "number" in types:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -MAX_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = MAX_INTEGER
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = DECIMAL_STEP
    return out


def request_grammar(tools, choice: str, parallel: bool, response_format, *, thinking: bool = False) -> str | None:
    """The grammar one generation must follow: forced calls when `choice` (tools.check_tool_choice's) is
    "required" or a function's name, else the response format's; None for free text."""
    if choice in ("auto", "none"):
        return response_grammar(response_format, thinking=thinking)
    return tool_call_grammar(tools, choice, parallel_calls(choice, parallel), thinking=thinking)


# -- forced tool calls ------------------------------------------------------------------------------


def tool_call_grammar(tools: list, choice: str, parallel: bool = True, *, thinking: bool = False) -> str:
    """The grammar for a turn that must call a function: `choice` "required" (any of `tools`) or a function's
    name; one call, or with `parallel` one or more, in Gemma's syntax, then <|tool_response>. Arguments
    follow each function's `parameters` schema where it keeps to the common subset (see _Rules.value).
    `tools` are OpenAI-style and already checked (tools.check_tools)."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice != "required" and choice not in functions:
        raise GrammarError(f"tool_choice: no function named {choice!r} in tools", param="tool_choice")
    rules = _Rules()
    try:
        names = functions if choice == "required" else [choice]
        calls = [f"{_lit(name)} {rules.arguments(functions[name].get('parameters'))}" for name in names]
    except RecursionError:
        raise GrammarError("tools: a parameters schema is nested too deeply", param="tools") from None
    body = (
        f"call{'+' if parallel else ''} <[{TOOL_RESPONSE_OPEN}]>\n"
        f'call: <[{TOOL_CALL_OPEN}]> "call:" ({" | ".join(calls)}) <[{TOOL_CALL_CLOSE}]>\n'
    )
    return _checked(_start(body, thinking) + "\n".join(rules.lines) + GEMMA_VALUES, "tools")


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _literal(value) -> str:
    """A JSON value as a Lark expression for exactly the text the template writes for it."""
    if isinstance(value, str):
        return (
            f"<[{STRING_DELIM}]> {_lit(value)} <[{STRING_DELIM}]>"
            if value
            else f"<[{STRING_DELIM}]> <[{STRING_DELIM}]>"
        )
    if isinstance(value, dict):  # the template's dictsort: keys compared lowercased
        pairs = [f"{_lit(str(k) + ':')} {_literal(v)}" for k, v in sorted(value.items(), key=lambda kv: kv[0].lower())]
        return '"{" ' + ' "," '.join(pairs) + ' "}"'
    if isinstance(value, list):
        return '"[" ' + ' "," '.join(map(_literal, value)) + ' "]"'
    return _lit(json.dumps(value))  # numbers as jinja prints them, true, false, null


class _Rules:
    """Lark rules for JSON schemas, in Gemma's syntax; what a rule cannot express becomes a generic value."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, body: str) -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def arguments(self, schema) -> str:
        """A call's {...}: the parameters' object schema, or any object."""
        return self.value(schema if isinstance(schema, dict) and schema else {"type": "object"})

    def value(self, s) -> str:
        """The subset: enum and const; anyOf/oneOf (as alternatives); type (one or a list), with nullable;
        object with properties and required; array with items, minItems, maxItems; string with minLength,
        maxLength; integer and number with (exclusive) minimum, maximum, multipleOf; boolean; null."""
        if not isinstance(s, dict):
            return "g_value"
        if "const" in s:
            return _literal(s["const"])
        if isinstance(s.get("enum"), list) and s["enum"]:
            return "(" + " | ".join(map(_literal, s["enum"])) + ")"
        options = s.get("anyOf") or s.get("oneOf")
        if isinstance(options, list) and options:
            return "(" + " | ".join(self.value(o) for o in options) + ")"
        types = s.get("type", "object" if "properties" in s else None)
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types:
            return "g_value"
        alternatives = [self.typed(t, s) for t in types] + (['"null"'] if s.get("nullable") else [])
        return "(" + " | ".join(alternatives) + ")"

    def typed(self, kind, s: dict) -> str:
        if kind == "string":
            return self.string(s.get("minLength", 0), s.get("maxLength"))
        if kind == "array":
            return self.array(s)
        if kind == "object":
            return self.object(s)
        if kind in ("integer", "number"):
            bounds = {k: s[k] for k in NUMERIC if k in s}
            if not bounds:
                return "G_INT" if kind == "integer" else "G_NUMBER"
            # Gemma writes numbers as JSON does: llguidance's own JSON numbers keep to the bounds
            schema = {"type": kind, **bounds, "x-guidance": {"whitespace_flexible": False}}
            return self.add(f"%json {json.dumps(schema)}")
        return '("true" | "false")' if kind == "boolean" else '"null"' if kind == "null" else "g_value"

    def string(self, lo, hi) -> str:
        if not _bounds(lo, hi):
            lo, hi = 0, None
        if hi == 0:
            return f"<[{STRING_DELIM}]> <[{STRING_DELIM}]>"
        if (lo, hi) == (0, None):
            return "g_string"
        name = f"TEXT_{lo}_{hi or ''}"
        if not any(line.startswith(name + ":") for line in self.lines):
            self.lines.append(f"{name}: /(?s:.{{{max(lo, 1)},{hi or ''}}})/")
        return f"<[{STRING_DELIM}]> {name}{'?' if lo == 0 else ''} <[{STRING_DELIM}]>"

    def array(self, s: dict) -> str:
        item = self.value(s["items"]) if isinstance(s.get("items"), dict) else "g_value"
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if not _bounds(lo, hi):
            lo, hi = 0, None
        if hi == 0:
            return '"[" "]"'
        more = "" if hi == 1 else f' ("," {item})' + ("*" if hi is None else f"{{{max(lo - 1, 0)},{hi - 1}}}")
        items = self.add(item + more)
        return f'"[" {items}{"" if lo else "?"} "]"'

    def object(self, s: dict) -> str:
        """Properties in the template's order (dictsort: names compared lowercased), the required ones
        always, the others optional, commas only between pairs; no other keys."""
        props = s.get("properties")
        if not isinstance(props, dict):
            return "g_object"
        required = s.get("required") if isinstance(s.get("required"), list) else []
        keys = sorted(props, key=str.lower)
        if not keys:
            return '"{" "}"'
        pairs = [self.add(f"{_lit(k + ':')} {self.value(props[k])}") for k in keys]
        need = [k in required for k in keys]
        # rest[i]: the pairs from i on, each after a comma; first: the pairs from i on, the first without
        rest = [""] * (len(keys) + 1)
        for i in reversed(range(1, len(keys))):
            pair = f'"," {pairs[i]}'
            rest[i] = self.add(f"{pair if need[i] else f'({pair})?'} {rest[i + 1]}".strip())
        top = need.index(True) if any(need) else len(keys) - 1  # no pair before it is required
        first = self.add(f"{pairs[top]} {rest[top + 1]}".strip())
        for i in reversed(range(top)):
            first = self.add(f"{pairs[i]} {rest[i + 1]} | {first}".replace("  ", " "))
        return f'"{{" {first}{"" if any(need) else "?"} "}}"'


def _bounds(lo, hi) -> bool:
    """minLength/maxLength or minItems/maxItems that make sense: integers, 0 <= lo <= hi."""
    ints = all(isinstance(n, int) and not isinstance(n, bool) for n in (lo, 0 if hi is None else hi))
    return ints and 0 <= lo and (hi is None or lo <= hi)


# -- the mask ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str, vocab_size: int, stop_ids: tuple[int, ...]):
    """llguidance's tokenizer for a tokenizer.json: 2 s for 262,144 tokens (bench/host_overhead.py). Built
    from the token bytes read here, not by llguidance's own loader, which takes minutes on a tokenizer with
    10^5 added tokens (the tiny tokenizer padded to 262,144 ids has 261,136: 9 minutes); any tokenizer's
    decoder is read (tokens.TokenBytes), Metaspace's included."""
    from tokenizers import Tokenizer

    config = json.loads(Path(path).read_text(encoding="utf-8"))
    hf = Tokenizer.from_str(json.dumps(config)) if _continuing(config) else Tokenizer.from_file(path)
    tokens, special = token_bytes(hf)

    class Vocabulary:  # what llguidance.TokenizerWrapper reads
        eos_token_id, bos_token_id, special_token_ids = stop_ids[0], None, special

        def __call__(self, text: str) -> list[int]:
            return hf.encode(text, add_special_tokens=False).ids

    Vocabulary.tokens = tokens + [b""] * (vocab_size - len(tokens))  # ids past the tokenizer's: never allowed
    return _lib().LLTokenizer(_lib().TokenizerWrapper(Vocabulary()), eos_token=list(stop_ids))


def _continuing(config: dict) -> bool:
    """Turns off, in a tokenizer.json's `config`, the space a SentencePiece tokenizer puts before a text
    (Metaspace's prepend_scheme, a Prepend normalizer); whether there was one. llguidance tokenizes text
    that continues an output: with that space, a grammar's "{" would be forced as the token "▁{"."""
    changed = False
    pre = config.get("pre_tokenizer") or {}
    for step in pre.get("pretokenizers") or [pre]:
        if step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never":
            step["prepend_scheme"], changed = "never", True
    norm = config.get("normalizer") or {}
    if norm.get("type") == "Prepend":
        config["normalizer"], changed = None, True
    elif any(step.get("type") == "Prepend" for step in norm.get("normalizers") or []):
        norm["normalizers"] = [step for step in norm["normalizers"] if step.get("type") != "Prepend"]
        changed = True
    return changed


class Constraint:
    """A grammar followed token by token through one generation: `mask` the logits, sample, `advance`.

    The LLTokenizer is built from the bundle's tokenizer.json once per path; the model's vocabulary may
    be larger than the tokenizer's (ids past it are never allowed). Once the grammar is complete, only
    `stop_ids` are allowed. The mask may still leave nothing a caller can draw: a grammar this tokenizer
    cannot spell, or a caller's bans (the runtime refuses both, see runtime._Rule)."""

    def __init__(self, grammar: str, tokenizer_json: str | Path, vocab_size: int, stop_ids):
        self.tokenizer = _tokenizer(str(Path(tokenizer_json).resolve()), vocab_size, tuple(sorted(map(int, stop_ids))))
        self.matcher = _lib().LLMatcher(self.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"grammar: {_first_line(self.matcher.get_error())}", param=None)
        self.vocab_size, self.stop_ids = vocab_size, frozenset(map(int, stop_ids))
        self._bits = np.zeros((vocab_size + 31) // 32, np.int32)

    def allowed(self, banned: np.ndarray | None = None) -> np.ndarray:
        """A bool per token: may it come next? Never one of `banned` (ids: the caller's logit_bias bans)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        out = np.unpackbits(self._bits.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)
        if banned is not None:
            out[banned] = False
        return out

    def legal(self, token: int) -> bool:
        """Does the grammar take `token` now? Not every token of the mask: llguidance's mask may hold one its
        parser then refuses (an <unk> it reads as a byte no text has). A stop token ends a complete output, which
        llguidance's validation does not count as taking it."""
        if int(token) in self.stop_ids:
            return self.matcher.is_accepting()
        return self.matcher.validate_tokens([int(token)]) == 1

    def mask(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
        """A copy of `logits` (fp16 or fp32, one row of vocab_size) with every token the grammar forbids (or
        that `allowed`, when given, does not hold) at -inf; the caller's array stays the model's distribution
        (logprobs are reported from it)."""
        out = np.full_like(logits, -np.inf)
        np.copyto(out, logits, where=self.allowed() if allowed is None else allowed)
        return out

    def advance(self, token: int) -> None:
        """Consume the token drawn; one the grammar forbids (impossible after `mask`) is a GrammarError."""
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {int(token)} breaks the grammar: {_first_line(self.matcher.get_error())}")

    @property
    def done(self) -> bool:
        """The output so far is complete: a stop token may end it (or has)."""
        return self.matcher.is_accepting()
