"""Gemma 4's control tokens and the byte-level alphabet: the ids every runtime hard-codes; and
ControlTokens, which keeps text that spells a control token text.

The ids are those of the real 262,144-entry tokenizer (docs/CONTRACT.md §1); the tiny test tokenizer
places the same tokens at the same ids, so nothing here depends on which one a bundle carries.
"""

from __future__ import annotations

import functools

PAD, EOS, BOS, UNK, MASK = 0, 1, 2, 3, 4
THINK, CHANNEL_OPEN, CHANNEL_CLOSE, TURN_OPEN, TURN_CLOSE = 98, 100, 101, 105, 106
# function calling: declarations, calls and responses are bracketed by these; <|"|> delimits strings
TOOL_OPEN, TOOL_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE = 46, 47, 48, 49
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE, STRING_DELIM = 50, 51, 52

SPECIAL_TOKENS: dict[int, str] = {
    PAD: "<pad>",
    EOS: "<eos>",
    BOS: "<bos>",
    UNK: "<unk>",
    MASK: "<mask>",
    TOOL_OPEN: "<|tool>",
    TOOL_CLOSE: "<tool|>",
    TOOL_CALL_OPEN: "<|tool_call>",
    TOOL_CALL_CLOSE: "<tool_call|>",
    TOOL_RESPONSE_OPEN: "<|tool_response>",
    TOOL_RESPONSE_CLOSE: "<tool_response|>",
    STRING_DELIM: '<|"|>',
    THINK: "<|think|>",
    CHANNEL_OPEN: "<|channel>",
    CHANNEL_CLOSE: "<channel|>",
    TURN_OPEN: "<|turn>",
    TURN_CLOSE: "<turn|>",
}

STOP_IDS = (EOS, TURN_CLOSE)  # generation always ends on these, whatever the generation config says


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet in byte order (`bytes_to_unicode`): printable bytes stand for
    themselves, the rest are shifted past U+0100, so every byte is a visible character."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, shift = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shift))
            shift += 1
    return symbols


class ControlTokens:
    """Tells a tokenizer's control tokens from text that merely spells them.

    A tokenizer matches its special tokens anywhere in a string, so a user who types "<turn|>" would end
    the turn. `escape` breaks every such spelling in a piece of text with `mark`, a character found nowhere
    else; `encode` then takes the control tokens of a rendered prompt as they are, and encodes each stretch
    between them that holds a mark as plain text (mark removed) with a copy of the tokenizer that matches
    no special token: the text keeps exactly the ids it would have had, were it not a control token's name."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def _plain(self):
        # built only once someone spells a control token: a copy of the real tokenizer takes a second and ~100 MB
        plain = type(self.tokenizer).from_str(self.tokenizer.to_str())
        plain.encode_special_tokens = True
        return plain

    def escape(self, text: str, mark: str) -> str:
        """`text` with `mark` after the first character of every control token it spells (again, while
        breaking one reveals another inside it)."""
        while True:
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            # a one-character control token cannot be broken this way (Gemma has none)
            cuts = [a + 1 for i, (a, b) in zip(enc.ids, enc.offsets) if i in self.ids and b - a > 1]
            if not cuts:
                return text
            text = mark.join(text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]))

    def encode(self, text: str, mark: str) -> list[int]:
        """The ids of `text`, a prompt rendered from escaped pieces: its control tokens, and the stretches
        between them, those holding a mark as plain text."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        if mark not in text:
            return enc.ids
        ids, run, start = [], [], 0
        for i, (a, b) in zip(enc.ids, enc.offsets):
            if i in self.ids:
                ids += self._stretch(text[start:a], run, mark) + [i]
                run, start = [], b
            else:
                run.append(i)
        return ids + self._stretch(text[start:], run, mark)

    def _stretch(self, text: str, ids: list[int], mark: str) -> list[int]:
        return self._plain.encode(text.replace(mark, ""), add_special_tokens=False).ids if mark in text else ids
