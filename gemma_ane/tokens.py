"""Gemma 4's control tokens and the byte-level alphabet: the ids every runtime hard-codes.

The ids are those of the real 262,144-entry tokenizer (docs/CONTRACT.md §1); the tiny test tokenizer
places the same tokens at the same ids, so nothing here depends on which one a bundle carries.
"""

from __future__ import annotations

PAD, EOS, BOS, UNK, MASK = 0, 1, 2, 3, 4
THINK, CHANNEL_OPEN, CHANNEL_CLOSE, TURN_OPEN, TURN_CLOSE = 98, 100, 101, 105, 106

SPECIAL_TOKENS: dict[int, str] = {
    PAD: "<pad>",
    EOS: "<eos>",
    BOS: "<bos>",
    UNK: "<unk>",
    MASK: "<mask>",
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
