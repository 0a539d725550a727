"""`generate` (one prompt) and what `chat` shares with it: sampling options, prompt cache files."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

from ..errors import InputError
from ..runtime.audio import load_audio
from ..runtime.device import BACKENDS
from ..runtime.grammar import GrammarError, response_grammar
from ..runtime.images import MAX_PIXELS
from ..runtime.sampling import FIELDS, GENERATION_CONFIG_FIELDS, SamplingParams
from ..runtime.tokens import TokenBytes
from ..runtime.tools import MAX_DEPTH
from .steps import add_quiet, step, writable

DRAFT_HELP = "speculative decoding: the bundle's drafter proposes K tokens a verify call (convert --assistant)"


def add_image_pixels(s):
    s.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_PIXELS,
        metavar="N",
        help=f"largest width*height of an image, read from its header before decoding (default {MAX_PIXELS})",
    )


def sampling(a) -> dict:
    """The sampling flags given (sampling.FIELDS), as stream_generate's keyword arguments."""
    out = {f.name: getattr(a, f.name) for f in FIELDS if getattr(a, f.name) is not None}
    if "logit_bias" in out:
        out["logit_bias"] = dict(out["logit_bias"])
    SamplingParams(**out).validate()  # a value out of range is refused before the bundle loads
    return out


def _bias(text: str) -> tuple[int, float]:
    """--logit-bias's ID=BIAS; the ranges are checked where every caller's are (SamplingParams)."""
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ID=BIAS, e.g. 106=-100") from None


MAX_STDIN_PROMPT = 4 << 20  # bytes `-p -` reads: far past any context, short of a pipe that never ends


def read_prompt(text: str, flag: str = "--prompt") -> str:
    """The prompt as given, or standard input's for `-` (read with a bound; the one newline `echo` ends it with
    dropped)."""
    if text != "-":
        return text
    data = sys.stdin.buffer.read(MAX_STDIN_PROMPT + 1)
    if len(data) > MAX_STDIN_PROMPT:
        raise InputError(f"{flag} -: standard input holds more than {MAX_STDIN_PROMPT >> 20} MiB")
    try:
        return data.decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError as e:
        raise InputError(f"{flag} -: standard input is not UTF-8 (byte {e.start})") from None


def cmd_generate(a):
    import dataclasses

    from .. import load

    a.prompt = read_prompt(a.prompt)
    kw = dict(max_tokens=a.max_tokens, raw=a.raw, enable_thinking=a.think, system=a.system, **sampling(a))
    if a.json_schema is not None:
        kw["response_format"] = _response_format(a.json_schema)
    if a.audio and a.raw:
        raise InputError("--audio: a raw prompt has no chat template to place the clip in; drop --raw")
    if a.prompt_cache:
        writable(a.prompt_cache, "--prompt-cache")
    # each clip read before the bundle loads: a missing or bad file costs no load; the samples are what runs
    clips = [{"type": "audio", "audio": load_audio(path, "--audio")} for path in a.audio or ()]
    if a.image or clips:
        if a.raw:
            raise InputError("--image: a raw prompt has no chat template to place the image in; drop --raw")
        content = [{"type": "image", "image": path} for path in a.image or ()] + clips
        content.append({"type": "text", "text": a.prompt})
        system = [{"role": "system", "content": kw.pop("system")}] if a.system else []
        kw["messages"] = [*system, {"role": "user", "content": content}]
    with step(a, f"loading {a.bundle}"):
        model = load(a.bundle, backend=a.backend, max_image_pixels=a.max_image_pixels)
    model.use_drafts(a.draft)
    load_cache(model, a.prompt_cache)
    prompt = None if a.image or clips else a.prompt
    if a.json:
        result = model.generate(prompt, **kw)
        save_cache(model, a.prompt_cache, result.prompt_tokens, a.system, a.prompt, a.think)
        out = dataclasses.asdict(result)
        if result.logprobs:  # each token's text beside its id, as the server's logprobs give it
            out["token_text"] = [piece(model.tokenizer, t) for t in result.tokens]
            out["top_logprobs"] = [[[t, piece(model.tokenizer, t), lp] for t, lp in top] for top in result.top_logprobs]
        print(json.dumps(out))
        return 0
    rows = []
    for ev in model.stream_generate(prompt, **kw):
        if ev.reasoning:
            sys.stderr.write(ev.reasoning)
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        if ev.logprob is not None:
            rows.append((ev.token, ev.logprob, ev.top_logprobs))
    sys.stdout.write("\n")
    if rows:
        print(logprob_table(model.tokenizer, rows))
    print(_summary(ev), file=sys.stderr)
    save_cache(model, a.prompt_cache, ev.prompt_tokens, a.system, a.prompt, a.think)
    return 0


def piece(tokenizer, token: int) -> str:
    """A token's own text, as the server's logprobs show it; a piece of a character shows its bytes (<0xE2>)."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    if "\ufffd" in text:
        raw = TokenBytes(tokenizer)(token) or b""
        text = "".join(f"<0x{b:02X}>" for b in raw) or text
    return text


def logprob_table(tokenizer, rows: list) -> str:
    """--logprobs as text: each generated token with its logprob, then the alternatives with theirs."""
    lines = ["logprobs (token, logprob | alternatives):"]
    for token, lp, top in rows:
        alternatives = "  ".join(f"{json.dumps(piece(tokenizer, t))} {x:.3f}" for t, x in top)
        lines.append(f"  {json.dumps(piece(tokenizer, token)):<16} {lp:8.3f}" + (f" | {alternatives}" if top else ""))
    return "\n".join(lines)


def cmd_tokenize(a):
    """Text to token ids and their pieces (--logit-bias takes ids), or --decode's ids back to text."""
    from ..runtime.model import bundle_tokenizer

    tokenizer = bundle_tokenizer(a.bundle)
    if a.decode:
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        past = [t for t in a.decode if t >= n]
        if past:
            raise InputError(f"--decode: token id {past[0]} is past the vocabulary ({n} tokens)")
        print(tokenizer.decode(a.decode, skip_special_tokens=False))
        return 0
    ids = tokenizer.encode(read_prompt(a.text, "TEXT"), add_special_tokens=False).ids
    if a.json:
        print(json.dumps({"ids": ids, "pieces": [piece(tokenizer, t) for t in ids]}))
        return 0
    print(" ".join(map(str, ids)))
    for t in ids:
        print(f"  {t:>7}  {json.dumps(piece(tokenizer, t))}")
    return 0


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected token ids, e.g. 106,2") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: token ids are not negative")
    return ids


def _response_format(text: str) -> dict:
    """--json-schema's value, inline JSON or a file holding it, as OpenAI's response_format."""
    source = "--json-schema"
    if not text.lstrip().startswith(("{", "[")):
        try:
            text, source = Path(text).read_text(), text
        except OSError as e:
            raise InputError(f"--json-schema {text}: cannot read ({e.strerror or e})") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{source}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:  # the decoder recurses a level at a time: some thousand levels exhaust the stack
        raise InputError(f"{source}: nested more than {MAX_DEPTH} deep") from None
    if not isinstance(schema, dict):
        raise InputError(f"{source}: a JSON schema is an object, not {type(schema).__name__}")
    fmt = {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    fmt = fmt if schema else {"type": "json_object"}
    try:
        response_grammar(fmt)  # a schema the grammar engine refuses is refused here, before loading anything
    except GrammarError as e:
        problem = str(e).removeprefix(f"{e.param}: ") if e.param else str(e)
        raise InputError(f"{source}: {problem}") from None
    return fmt


def load_cache(model, path) -> None:
    if path and os.path.exists(path):
        print(f"prompt cache {path}: {model.load_prompt_cache(path)} tokens", file=sys.stderr)


def save_cache(model, path, prompt_tokens: int, system, prompt, think: bool) -> None:
    """Save the caches of the system turn (without one, of the whole prompt) for the next run."""
    if not path:
        return
    ends = []
    if system:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        ends = model.turn_ends(messages, model.prompt_ids(messages=messages, enable_thinking=think), think)
    position = model.save_prompt_cache(path, ends[0] if ends else prompt_tokens)
    print(f"prompt cache {path}: saved {position} tokens", file=sys.stderr)


def _summary(last) -> str:
    """One line from the last event's Stats, as mlx-lm's generate prints them. The decode rate counts the tokens
    after the first, so an answer of one token has none to show."""
    n = last.generated_tokens
    generation = f"{n} token" if n == 1 else f"{n} tokens, {last.decode_tokens_per_s:.1f} tok/s"
    return (
        f"prompt: {last.prompt_tokens} tokens ({last.reused_tokens} reused), {last.prefill_tokens_per_s:.1f} tok/s"
        f" | generation: {generation}"
        + (
            f" | drafts: {last.acceptance_rate:.0%} accepted, {last.tokens_per_verify:.2f} tokens a verify call"
            if last.tokens_per_verify
            else ""
        )
        + "".join(f" | climbed: {c}" for c in last.crossings)
        + f" | finish: {last.finish_reason}"
    )


BACKEND_HELP = "coreml: Core ML (macOS); mil: our MIL executor (any OS, slower); auto: coreml where it runs, else mil"


def _with_default(f) -> str:
    """A sampling flag's help with its default: the generation config's where the bundle may set one
    (SamplingParams.from_generation_config), else SamplingParams' own."""
    if "default" in f.help:
        return f.help
    default = {d.name: d.default for d in fields(SamplingParams)}[f.name]
    shown = "none" if default is None else default
    bundle = "the bundle's generation config, else " if f.name in GENERATION_CONFIG_FIELDS else ""
    return f"{f.help} (default: {bundle}{shown})"


def add_sampling(s):
    s.add_argument("--backend", default="auto", choices=BACKENDS, help=BACKEND_HELP)
    s.add_argument("--max-tokens", type=int, default=256, help="most tokens an answer may have")
    s.add_argument("--system", help="a system turn before the conversation")
    s.add_argument("--think", action="store_true", help="thinking mode: reasoning goes to stderr")
    for f in FIELDS:  # one flag a sampling field, as the server takes them
        flag = "--" + f.name.replace("_", "-")
        if f.kind is dict:
            s.add_argument(flag, type=_bias, action="append", metavar="ID=BIAS", help=f.help)
        else:
            s.add_argument(flag, type=f.kind, metavar="N" if f.kind is int else "X", help=_with_default(f))
    s.add_argument("--draft", type=int, default=0, metavar="K", help=DRAFT_HELP)
    s.add_argument(
        "--prompt-cache",
        metavar="FILE",
        help="start from the caches saved in FILE (if it exists); save the system turn's (or the prompt's) there",
    )
    add_quiet(s)


def add_commands(sub) -> None:
    s = sub.add_parser("generate", help="generate text from a prompt")
    s.add_argument("bundle", help="bundle directory")
    s.add_argument(
        "-p", "--prompt", required=True, help="the user's message (with --raw: the whole text; -: standard input)"
    )
    s.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="an image the prompt is about, placed before its text (repeat for more; needs a bundle with vision)",
    )
    s.add_argument(
        "--audio",
        action="append",
        metavar="PATH",
        help="a sound clip the prompt is about (WAV, FLAC, ...), placed before its text (repeat for more; needs a "
        "bundle with an audio model)",
    )
    add_image_pixels(s)
    s.add_argument("--raw", action="store_true", help="no chat template: <bos> + the text")
    s.add_argument("--json", action="store_true", help="print one JSON object with the whole result")
    s.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="constrain the answer to JSON following SCHEMA (a JSON schema, inline or a file; '{}': any object)",
    )
    add_sampling(s)
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("tokenize", help="text to token ids and pieces (for --logit-bias), or ids back to text")
    s.add_argument("bundle", help="bundle directory (its tokenizer)")
    s.add_argument("text", nargs="?", default="-", help="the text (-, or none: standard input)")
    s.add_argument("--decode", type=_ids, metavar="IDS", help="token ids (106,2 or '106 2') to turn back into text")
    s.add_argument("--json", action="store_true", help='print {"ids": [...], "pieces": [...]}')
    s.set_defaults(fn=cmd_tokenize)
