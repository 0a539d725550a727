"""A small stand-in for Gemma 4's tokenizer files, plus our own chat template.

The real tokenizer has 262144 entries; tests and tiny random models need something that loads the same
way (transformers ``AutoTokenizer``), keeps Gemma 4's control-token ids, renders the same prompts and
round-trips any text, while staying a few kilobytes.

Layout of the vocabulary built here:

- ids 0..127: special tokens. Gemma 4's own ones sit at their real ids, the image tokens at 120..122
  (``TINY_MEDIA_TOKENS``), with ``audio=True`` the audio tokens at 123..125 (``TINY_AUDIO_TOKENS``); the gaps
  hold ``<unusedN>``.
- ids 128..383: the 256 byte symbols of the GPT-2 byte-level alphabet, id = 128 + byte, so every
  string is encodable and decodes back byte for byte.
- ids 384..: BPE merges learned from ``_CORPUS``, then ``<unusedN>`` specials if the corpus runs out
  of merges before ``vocab_size`` is reached.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ..files import write_atomic, write_json
from ..runtime.tokens import SPECIAL_TOKENS, byte_symbols

__all__ = [
    "GEMMA4_CHAT_TEMPLATE",
    "MIN_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "TINY_AUDIO_TOKENS",
    "TINY_MEDIA_TOKENS",
    "build_tokenizer",
    "write_tokenizer_files",
]

_SPECIAL_BLOCK = 128
_BYTE_BASE = _SPECIAL_BLOCK
MIN_VOCAB_SIZE = _BYTE_BASE + 256
# The image tokens (begin, placeholder, end): the real tokenizer has them at 255999, 258880 and 258882, past any
# tiny vocabulary, so here they take free ids of the special block, and a tiny config.json names these ids (its
# boi/image/eoi_token_id) as the real one names its own. Nothing hard-codes either set: bundles carry the ids.
TINY_MEDIA_TOKENS = {120: "<|image>", 121: "<|image|>", 122: "<image|>"}
# The audio tokens (begin, placeholder, end; the real ones are 256000, 258881 and 258883), only in the tokenizers of
# presets with an audio tower that runs: every other preset's tokenizer keeps <unused123..125>, byte for byte.
TINY_AUDIO_TOKENS = {123: "<|audio>", 124: "<|audio|>", 125: "<audio|>"}

# Same as the E2B config's max_position_embeddings; the bundle's own context limit is enforced elsewhere.
_MODEL_MAX_LENGTH = 131072

GEMMA4_CHAT_TEMPLATE = """\
{#- Gemma 4 turns: <|turn>{role}\\n{content}<turn|>\\n. Thinking is switched on by <|think|> opening the
    system turn, so that turn is synthesised when the conversation has none. -#}
{%- set roles = {'system': 'system', 'user': 'user', 'assistant': 'model', 'model': 'model'} -%}
{%- set thinking = enable_thinking | default(false) -%}
{{- bos_token -}}
{%- if thinking and messages[0]['role'] != 'system' -%}
    {{- '<|turn>system\\n<|think|>\\n<turn|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] not in roles -%}
        {{- raise_exception("Unknown role '" ~ message['role'] ~ "': expected system, user, assistant or model") -}}
    {%- endif -%}
    {{- '<|turn>' ~ roles[message['role']] ~ '\\n' -}}
    {%- if loop.first and message['role'] == 'system' and thinking -%}
        {{- '<|think|>\\n' -}}
    {%- endif -%}
    {%- set content = message['content'] | default('') -%}
    {%- if content is string -%}
        {{- content | trim -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part['type'] == 'text' -%}
                {{- part['text'] | trim -}}
            {%- elif part['type'] in ['image', 'image_url'] -%}
                {{- '<|image|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<turn|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|turn>model\\n' -}}
{%- endif -%}
"""

# The template of tokenizers with audio tokens: audio parts render as Gemma 4's own template renders them.
GEMMA4_AUDIO_CHAT_TEMPLATE = GEMMA4_CHAT_TEMPLATE.replace(
    """            {%- elif part['type'] in ['image', 'image_url'] -%}
                {{- '<|image|>' -}}
""",
    """            {%- elif part['type'] in ['image', 'image_url'] -%}
                {{- '<|image|>' -}}
            {%- elif part['type'] in ['audio', 'input_audio'] -%}
                {{- '<|audio|>' -}}
""",
)

# Training text for the merges. It only has to make frequent English words (and the role names that
# appear in prompts) single tokens; changing it changes every tokenizer.json built from it.
_CORPUS = """\
The user asks a question and the model gives an answer. The system message tells the model how to
behave, what to say and what not to say. A good answer is short, clear and correct. When the model
does not know the answer, it should say so instead of making something up.

Hello world! This is a small piece of English text. It is used to learn which letters often come
together, so that common words such as the, and, of, to, in, is, it, that, for, you, with, on, as,
are, was, this, be, at, have, from, or, one, had, by, but, not, what, all, were, we, when, your, can,
said, there, use, an, each, which, she, do, how, their, if, will, up, other, about, out, many, then,
them, these, so, some, her, would, make, like, him, into, time, has, look, two, more, write, go, see,
number, no, way, could, people, my, than, first, water, been, call, who, its, now, find, long, down,
day, did, get, come, made, may, part, over, new, sound, take, only, little, work, know, place, year,
live, me, back, give, most, very, after, thing, our, just, name, good, sentence, man, think, say,
great, where, help, through, much, before, line, right, too, mean, old, any, same, tell, boy, follow,
came, want, show, also, around, form, three, small, set, put, end, does, another, well, large, must,
big, even, such, because, turn, here, why, ask, went, men, read, need, land, different, home, us,
move, try, kind, hand, picture, again, change, off, play, spell, air, away, animal, house, point,
page, letter, mother, answer, found, study, still, learn, should, world, high, every, near, add,
food, between, own, below, country, plant, last, school, father, keep, tree, never, start, city,
earth, eye, light, thought, head, under, story, saw, left, few, while, along, might, close,
something, seem, next, hard, open, example, begin, life, always, those, both, paper, together, got,
group, often, run, important, until, children, side, feet, car, mile, night, walk, white, sea, began,
grow, took, river, four, carry, state, once, book, hear, stop, without, second, later, miss, idea,
enough, eat, face, watch, far, really, almost, let, above, girl, sometimes, mountain, cut, young,
talk, soon, list, song, being, leave, family.

The quick brown fox jumps over the lazy dog. The dog was not lazy at all; it was thinking about the
fox, and about the river, and about the long road home. In the morning the children went to school,
and in the evening they came back to the house to eat, read a book and sleep.

Numbers are written with digits: 0 1 2 3 4 5 6 7 8 9 10 12 100 2024 3.14 42. Code uses symbols like
(a + b) * c = d, x[i] -> y, {"key": "value"}, and names like print, return, import, def, class, self.
Please think step by step, then write the final answer. Thank you for your help!

system
You are a helpful assistant.
user
What is the capital of France?
model
The capital of France is Paris.
user
Thank you.
model
You are welcome.
"""


def _pre_tokenizer() -> pre_tokenizers.ByteLevel:
    # No prefix space: decode(encode(text)) must give text back unchanged.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _learn_merges(count: int, corpus: str = _CORPUS) -> list[tuple[str, str]]:
    """BPE merges over ``corpus`` creating up to ``count`` distinct new tokens.

    Done in Python rather than with ``tokenizers.trainers`` so that determinism (ties broken by the
    pair itself) is guaranteed by construction, not by a library version's hash-map iteration order.
    """
    words = collections.Counter(piece for piece, _ in _pre_tokenizer().pre_tokenize_str(corpus))
    spelled = {tuple(word): freq for word, freq in sorted(words.items())}
    merges: list[tuple[str, str]] = []
    # Two merges can spell the same string ("a"+"bc" and "ab"+"c"), so count strings, not merges.
    new_tokens: set[str] = set()
    while len(new_tokens) < count:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for symbols, freq in spelled.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        new_tokens.add(best[0] + best[1])
        spelled = {_merge(symbols, best): freq for symbols, freq in spelled.items()}
    return merges


def _merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if symbols[i : i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def build_tokenizer(vocab_size: int, corpus: str = _CORPUS, audio: bool = False) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids and Gemma 4's special-token ids, its merges
    learned from ``corpus`` (a model trained on some text can have them from that text: shorter prompts); with
    ``audio``, the audio tokens too (TINY_AUDIO_TOKENS)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} ({_SPECIAL_BLOCK} special ids + 256 byte symbols), "
            f"got {vocab_size}"
        )
    media = {**TINY_MEDIA_TOKENS, **(TINY_AUDIO_TOKENS if audio else {})}
    specials = [SPECIAL_TOKENS.get(i) or media.get(i, f"<unused{i}>") for i in range(_SPECIAL_BLOCK)]
    vocab = {token: i for i, token in enumerate(specials)}
    for byte, symbol in enumerate(byte_symbols()):
        vocab[symbol] = _BYTE_BASE + byte

    merges = _learn_merges(vocab_size - len(vocab), corpus)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    # Whatever the corpus could not fill becomes reserved tokens, as Gemma's own <unusedN> are.
    padding = [f"<unused{i}>" for i in range(len(vocab), vocab_size)]
    for token in padding:
        vocab[token] = len(vocab)

    # Every byte has a symbol, so <unk> is never produced; it is named only to match tokenizer_config.json.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    # Added as special tokens so they are cut out of raw text before BPE and skipped by
    # decode(skip_special_tokens=True); they already have their ids in the vocab.
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials + padding])
    return tokenizer


def write_tokenizer_files(
    out_dir: str | os.PathLike, vocab_size: int, corpus: str = _CORPUS, audio: bool = False
) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into ``out_dir`` (merges from ``corpus``;
    with ``audio``, the audio tokens and the template that renders audio parts)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, corpus, audio)
    template = GEMMA4_AUDIO_CHAT_TEMPLATE if audio else GEMMA4_CHAT_TEMPLATE
    config = {
        # transformers 5 maps this legacy name to its TokenizersBackend, which reads tokenizer.json as is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        # The chat template writes <bos> itself; adding it again on encode would double it.
        "add_bos_token": False,
        "add_eos_token": False,
        # transformers' clean-up drops spaces before punctuation, which breaks exact round trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": _MODEL_MAX_LENGTH,
        "chat_template": template,
    }
    write_atomic(out / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    write_json(out / "tokenizer_config.json", config)
    write_atomic(out / "chat_template.jinja", template)
