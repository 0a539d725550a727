"""Gemma 4's control tokens and the byte-level alphabet: the ids every runtime hard-codes; and
ControlTokens, which keeps text that spells a control token text.

The ids are those of the real 262,144-entry tokenizer (docs/CONTRACT.md §1); the tiny test tokenizer
places the same tokens at the same ids, so nothing here depends on which one a bundle carries.
"""

from __future__ import annotations

import functools
import json
import re

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


# the byte-level alphabet's characters -> the bytes they stand for (as latin-1); others fail the encode
_BYTE_LEVEL = {ord(c): chr(b) for b, c in enumerate(byte_symbols())}
_BYTE_LEVEL |= {b: "\uffff" for b in range(256) if b not in _BYTE_LEVEL}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# decoders whose effect on one piece is a substitution (Strip and Fuse act on the whole text only)
_SUBSTITUTING = {"ByteLevel", "ByteFallback", "Replace", "Metaspace", "Fuse", "Strip"}
_SENTINEL = "\x01"  # a piece before the one read, so a decoder's rule for the text's start does not apply


class TokenBytes:
    """The bytes one token stands for, for any Hugging Face tokenizer (`tokenizers.Tokenizer`, or anything with
    `id_to_token` and an optional `decoder`): the byte-level alphabet (GPT-2 style), byte fallback's <0xHH>,
    Replace and Metaspace's stand-in for a space (SentencePiece style: Gemma's, and most of the Hub's); any
    other decoder is asked what the piece adds after another. Decoding a token alone cannot say: a piece
    holding part of a character decodes to U+FFFD, and a SentencePiece word loses its leading space."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoder = getattr(tokenizer, "decoder", None)
        config = json.loads(self.decoder.__getstate__()) if self.decoder is not None else {}
        steps = config.get("decoders") or ([config] if config else [])
        kinds = {step.get("type") for step in steps}
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds or not kinds  # no decoder: <0xHH> still names a byte
        self.substitutions = [
            (s["replacement"], " ") if s["type"] == "Metaspace" else (s["pattern"].get("String"), s["content"])
            for s in steps
            if s.get("type") in ("Metaspace", "Replace")
        ]
        self.substituting = kinds <= _SUBSTITUTING and all(a for a, _ in self.substitutions)

    def __call__(self, token: int) -> bytes | None:
        """The token's bytes; None for an id the tokenizer has no piece for, or a piece outside its alphabet."""
        return self.piece(self.tokenizer.id_to_token(token))

    def piece(self, name: str | None) -> bytes | None:
        """The bytes a piece (a token's name in the vocabulary) stands for, as __call__."""
        if name is None:
            return None
        if self.byte_level:
            try:
                return name.translate(_BYTE_LEVEL).encode("latin-1")
            except UnicodeEncodeError:
                return None
        m = _BYTE_PIECE.fullmatch(name) if self.byte_fallback else None
        if m:
            return bytes([int(m.group(1), 16)])
        if self.substituting:
            for a, b in self.substitutions:
                name = name.replace(a, b)
            return name.encode()
        before = self.decoder.decode([_SENTINEL])
        text = self.decoder.decode([_SENTINEL, name])
        return text[len(before) :].encode() if text.startswith(before) else None


def token_bytes(tokenizer) -> tuple[list[bytes], list[int]]:
    """Every token's bytes and the special ids, as llguidance's loader (toktrie_hf_tokenizers) reads them: added
    tokens marked special or spelled <...> are special, their bytes their name; the others' bytes are
    TokenBytes'; a piece it cannot read keeps its added content, or no bytes. The one reading of token bytes:
    the grammar's vocabulary and the server's logprobs both use it."""
    read = TokenBytes(tokenizer)
    added = tokenizer.get_added_tokens_decoder()
    special = sorted(
        i for i, t in added.items() if t.special or (t.content.startswith("<") and t.content.endswith(">"))
    )
    tokens, is_special = [], set(special)
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        name = tokenizer.id_to_token(i)
        token = None if name is None else name.encode() if i in is_special else read.piece(name)
        tokens.append(token if token is not None else added[i].content.encode() if i in added else b"")
    return tokens, special
