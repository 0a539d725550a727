"""Prompts in, text out: the chat template, streaming detokenisation, thinking and stop strings.

A bundle is a downloaded file, so its chat template is untrusted code: it is rendered in jinja2's
ImmutableSandboxedEnvironment, which refuses attribute access to Python internals.
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokens import CHANNEL_CLOSE, CHANNEL_OPEN

ROLES = {"system": "system", "user": "user", "assistant": "model", "model": "model"}


class ChatError(ValueError):
    """A conversation or template that cannot be rendered; the message says why."""


def _parts(message: dict) -> list[str]:
    content = message.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return [p["text"] for p in content]
    raise ChatError("message content must be a string or a list of text parts (the built-in formatter is text-only)")


def _strip_thinking(text: str) -> str:
    """The template's strip_thinking: a model turn loses every <|channel>...<channel|> block (an unclosed one
    runs to the end of its part)."""
    return "".join(part.split("<|channel>")[0] for part in text.split("<channel|>")).strip()


def gemma4_prompt(
    messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = False, bos_token: str = "<bos>"
) -> str:
    """The built-in Gemma 4 formatter, for bundles that carry no template: what google/gemma-4-E2B-it's own
    chat template renders for a text-only conversation without tools (tests/test_chat.py holds the two equal)."""
    for m in messages:
        if m.get("role") not in ROLES:
            raise ChatError(f"unknown role {m.get('role')!r}: expected system, user, assistant or model")
    out = [bos_token]
    system = messages[0] if messages and messages[0]["role"] == "system" else {}
    if system or enable_thinking:  # thinking is switched on by <|think|> opening a system turn
        sep = " " if isinstance(system.get("content"), list) else ""  # the template's quirk: list parts gain a space
        text = "".join(p.strip() + sep for p in _parts(system))
        out.append("<|turn>system\n" + ("<|think|>\n" if enable_thinking else "") + text + "<turn|>\n")
    turns = messages[1:] if system else messages
    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    for i, m in enumerate(turns):
        role = ROLES[m["role"]]
        # Consecutive assistant messages are one model turn: no closer after the first, no opener after it.
        if not (role == "model" and i > 0 and turns[i - 1]["role"] == "assistant"):
            out.append(f"<|turn>{role}\n")
        thought = m.get("reasoning") or m.get("reasoning_content")
        if thought and i > last_user:  # reasoning from before the last user turn is not replayed
            out.append(f"<|channel>thought\n{thought}\n<channel|>")
        out.append("".join(_strip_thinking(p) if role == "model" else p.strip() for p in _parts(m)))
        if not (role == "model" and i + 1 < len(turns) and turns[i + 1]["role"] == "assistant"):
            out.append("<turn|>\n")
    if add_generation_prompt:
        out.append("<|turn>model\n")
    return "".join(out)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "<bos>", eos_token: str = "<eos>"):
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self._template = None
        if source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message):
                raise TemplateError(message)

            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(source)
            except TemplateError as e:
                raise ChatError(f"chat template does not compile: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = False) -> str:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ChatError("messages must be a list of {'role', 'content'} objects")
        if self._template is None:
            return gemma4_prompt(messages, add_generation_prompt, enable_thinking, self.bos_token)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=None,
                documents=None,
            )
        except TemplateError as e:  # SecurityError included: a template reaching for internals
            raise ChatError(f"chat template failed: {e}") from None


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


class OutputParser:
    """Splits generated tokens into answer and reasoning (`<|channel>thought\\n ... <channel|>`),
    and applies stop strings, holding back any tail that could still become one."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.content = Detokenizer(tokenizer)
        self.reasoning = Detokenizer(tokenizer)
        self.in_thought, self._skip_label, self._label = False, False, ""
        self.stop = [s for s in (stop or []) if s]
        self.pending = ""  # answer text not yet released (could be a stop string's prefix)
        self.stopped = False
        self.text, self.reasoning_text = "", ""

    def add(self, token: int) -> Delta:
        if self.stopped:
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

    def _release(self, piece: str) -> str:
        self.pending += piece
        for s in self.stop:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending, self.stopped = self.pending[:i], "", True
                self.text += out
                return out
        hold = max((k for s in self.stop for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        self.text += out
        return out

    def finish(self) -> Delta:
        if self.stopped:
            return Delta()
        tail = self.pending + self.content.flush()
        self.pending = ""
        for s in self.stop:
            if s in tail:
                tail, self.stopped = tail[: tail.find(s)], True
        self.text += tail
        return Delta(content=tail)
