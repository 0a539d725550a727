"""Commands that run a bundle: `generate` (one prompt) and `chat` (a conversation on stdin)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

from ..errors import InputError
from ..runtime.audio import SAMPLE_RATE, AudioError, load_audio
from ..runtime.device import BACKENDS
from ..runtime.grammar import GrammarError, response_grammar
from ..runtime.images import MAX_PIXELS
from ..runtime.sampling import FIELDS, GENERATION_CONFIG_FIELDS, SamplingParams
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


def _sampling(a) -> dict:
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


def cmd_generate(a):
    import dataclasses

    from .. import load

    kw = dict(max_tokens=a.max_tokens, raw=a.raw, enable_thinking=a.think, system=a.system, **_sampling(a))
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
    _load_cache(model, a.prompt_cache)
    prompt = None if a.image or clips else a.prompt
    if a.json:
        result = model.generate(prompt, **kw)
        _save_cache(model, a.prompt_cache, result.prompt_tokens, a.system, a.prompt, a.think)
        print(json.dumps(dataclasses.asdict(result)))
        return 0
    for ev in model.stream_generate(prompt, **kw):
        if ev.reasoning:
            sys.stderr.write(ev.reasoning)
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(_summary(ev), file=sys.stderr)
    _save_cache(model, a.prompt_cache, ev.prompt_tokens, a.system, a.prompt, a.think)
    return 0


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


def _load_cache(model, path) -> None:
    if path and os.path.exists(path):
        print(f"prompt cache {path}: {model.load_prompt_cache(path)} tokens", file=sys.stderr)


def _save_cache(model, path, prompt_tokens: int, system, prompt, think: bool) -> None:
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
        + f" | finish: {last.finish_reason}"
    )


def _fit_context(model, head: list, messages: list, think: bool, max_tokens: int) -> list | None:
    """`messages` (after the system turn `head`) if their prompt leaves room for the answer (max_tokens,
    at most half the context). If not, the oldest exchanges go, with a note on stderr, until the prompt
    fills at most half the context, as llama.cpp's context shift does: the turns that follow then reuse
    the cached prompt instead of reprocessing it after a drop each. None, and a note, if even the last
    message alone does not fit."""
    ctx, room, sizes = model.context, min(max_tokens, model.context // 2), {}
    for k in range(0, len(messages), 2):  # whole exchanges, so what is kept starts with a user turn
        sizes[k] = len(model.prompt_ids(messages=head + messages[k:], enable_thinking=think))
        if sizes[k] + room <= ctx and (k == 0 or sizes[k] <= ctx // 2):
            break
    else:  # no half-context cut: the smallest that fits
        k = next((k for k, n in sizes.items() if n + room <= ctx), None)
        if k is None:
            print(
                f"(not sent: this message needs {sizes[len(messages) - 1]} prompt tokens and {room} "
                f"for the answer, more than the context of {ctx}; the conversation is unchanged)",
                file=sys.stderr,
            )
            return None
    if k:
        print(f"(dropped the {k} oldest turns to fit the context of {ctx})", file=sys.stderr)
    return messages[k:]


def cmd_chat(a):
    from .. import load

    if a.prompt_cache:
        writable(a.prompt_cache, "--prompt-cache")
    with step(a, f"loading {a.bundle}"):
        model = load(a.bundle, backend=a.backend)
    model.use_drafts(a.draft)
    _load_cache(model, a.prompt_cache)
    system, think, messages = a.system, a.think, []
    clips = []  # /audio's clips (samples), sent with the next message
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes arrive as surrogates, refused per line
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line == "/reset":
            messages, clips = [], []
            model.reset()
            print("(conversation cleared)")
            continue
        if line.startswith("/system"):
            system = line[len("/system") :].strip() or None
            messages, clips = [], []
            print(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)")
            continue
        if line.startswith("/think"):
            arg = line[len("/think") :].strip()
            if arg not in ("on", "off"):
                print("usage: /think on|off")
                continue
            think = arg == "on"
            print(f"(thinking {arg})")
            continue
        if line == "/audio" or line.startswith("/audio "):
            try:
                clips.append(_clip(model, line[len("/audio") :].strip()))
            except ValueError as e:  # no such file, not audio, too long: this command only, never the chat
                print(f"gemma-ane chat: error: {e}", file=sys.stderr)
                continue
            print(f"(audio: {len(clips[-1]) / SAMPLE_RATE:.1f} s, sent with your next message)")
            continue
        head = [{"role": "system", "content": system}] if system else []
        content = [{"type": "audio", "audio": x} for x in clips] + [{"type": "text", "text": line}] if clips else line
        clips = []
        try:
            fitted = _fit_context(model, head, [*messages, {"role": "user", "content": content}], think, a.max_tokens)
            if fitted is None:
                continue
            answer, last = _answer(model, head + fitted, think, a)
        except ValueError as e:  # text that is not text, a failing template: this turn only, never the chat
            print(f"gemma-ane chat: error: {e}", file=sys.stderr)
            continue
        if not messages:  # the first turn of a conversation: its system turn is what recurs
            _save_cache(model, a.prompt_cache, last.prompt_tokens, system, line, think)
        messages = [*fitted, {"role": "assistant", "content": answer}]
    return 0


def _clip(model, path: str):
    """/audio's clip: the file's samples, checked against the bundle's audio model (the error names the file)."""
    if not path:
        raise InputError("usage: /audio FILE")
    if model.audio is None:
        raise AudioError("/audio: this bundle has no audio model (converted without one)")
    return load_audio(path, "/audio", model.audio.max_seconds)


def _answer(model, convo: list[dict], think: bool, a):
    """Stream one answer (thinking to stderr, so stdout holds only the answers); (text, last event)."""
    answer = ""
    for ev in model.stream_generate(messages=convo, max_tokens=a.max_tokens, enable_thinking=think, **_sampling(a)):
        if ev.reasoning:
            sys.stderr.write(ev.reasoning)
            sys.stderr.flush()
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        answer += ev.text
    sys.stdout.write("\n")
    return answer, ev


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


def _add_sampling(s):
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
    s.add_argument("-p", "--prompt", required=True, help="the user's message (with --raw: the whole text)")
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
    _add_sampling(s)
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("chat", help="multi-turn chat (reads stdin; /reset, /system TEXT, /think on|off, /audio FILE)")
    s.add_argument("bundle", help="bundle directory")
    _add_sampling(s)
    s.set_defaults(fn=cmd_chat)
