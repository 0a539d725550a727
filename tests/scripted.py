"""A Model whose network is replaced by chosen tokens: the runtime's own Model, the real Gemma 4 chat
template (tests/fixtures) and the test tokenizer over an engine that returns flat logits, with a pick
that emits a script. Everything around the network is real (the prompt, the parser, the stop tokens,
the server's shapes), and prompts may be long: a random tiny model never calls a function by itself,
and Gemma's declarations alone would fill most of a tiny bundle's 128 positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gemma_ane.oracle.tokenizer_files import build_tokenizer
from gemma_ane.runtime.chat import ChatTemplate
from gemma_ane.runtime.model import Model

TEMPLATE = (Path(__file__).parent / "fixtures" / "gemma4_chat_template.jinja").read_text()
VOCAB = 1024

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# what the model writes to call them, as the template renders such calls
PARIS = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>'
TOKYO = '<|tool_call>call:get_time{zone:<|"|>Asia/Tokyo<|"|>}<tool_call|>'


class ScriptedEngine:
    """An engine without a network: flat logits (the scripted pick chooses), room for long prompts."""

    head, context, position = "logits", 4096, 0

    def __init__(self, vocab_size: int):
        self.logits = np.zeros(vocab_size, np.float32)
        self.crossings = []  # one context: no ladder to climb

    def prompt(self, ids, marks=(), cancelled=None, exact=False):
        self.position = len(ids)
        return 0, self.logits

    def feed(self, ids):
        self.position += len(ids)
        return [self.logits]

    def reset(self):
        self.position = 0


def scripted_model() -> Model:
    tokenizer = build_tokenizer(VOCAB)
    return Model(Path("."), ScriptedEngine(VOCAB), tokenizer, ChatTemplate(TEMPLATE), {}, {"vocab_size": VOCAB}, "none")


def script(model, monkeypatch, text: str) -> list[int]:
    """Make the model emit `text`'s tokens, whatever its logits say."""
    ids = model.tokenizer.encode(text, add_special_tokens=False).ids
    queue = list(ids)
    monkeypatch.setattr(model, "_pick", lambda sampler, logits: queue.pop(0))
    return ids
