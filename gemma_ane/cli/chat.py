"""`gemma-ane chat`: a conversation on stdin, as a REPL. Lines that start with `/` are commands (a table below,
listed by the banner and by /help); an unknown one is answered with that list and never reaches the model. `//text`
sends `/text`. Answers go to stdout, everything else (banner, notes, reasoning, stats) to stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InputError
from ..runtime.audio import SAMPLE_RATE, AudioError, load_audio
from .run import add_sampling, load_cache, sampling, save_cache
from .steps import step, writable


@dataclass
class Chat:
    """What a conversation carries between lines."""

    model: object
    system: str | None
    think: bool
    messages: list = field(default_factory=list)
    clips: list = field(default_factory=list)  # /audio's clips (samples), sent with the next message

    def clear(self) -> None:
        self.messages, self.clips = [], []


def _quit(chat: Chat, arg: str) -> bool:
    return True


def _help(chat: Chat, arg: str) -> None:
    print(HELP, file=sys.stderr)


def _reset(chat: Chat, arg: str) -> None:
    chat.clear()
    chat.model.reset()
    print("(conversation cleared)", file=sys.stderr)


def _system(chat: Chat, arg: str) -> None:
    chat.system = arg or None
    chat.clear()
    print(f"(system prompt {'set' if chat.system else 'cleared'}; conversation cleared)", file=sys.stderr)


def _think(chat: Chat, arg: str) -> None:
    if arg not in ("on", "off"):
        print("usage: /think on|off", file=sys.stderr)
        return
    chat.think = arg == "on"
    print(f"(thinking {arg})", file=sys.stderr)


def _audio(chat: Chat, arg: str) -> None:
    if not arg:
        raise InputError("usage: /audio FILE")
    if chat.model.audio is None:
        raise AudioError("/audio: this bundle has no audio model (converted without one)")
    chat.clips.append(load_audio(arg, "/audio", chat.model.audio.max_seconds))
    print(f"(audio: {len(chat.clips[-1]) / SAMPLE_RATE:.1f} s, sent with your next message)", file=sys.stderr)


# name -> (handler, its argument, what it does); a handler returning True ends the chat
COMMANDS: dict[str, tuple[Callable[[Chat, str], bool | None], str, str]] = {
    "help": (_help, "", "this list"),
    "quit": (_quit, "", "leave (Ctrl-D too)"),
    "exit": (_quit, "", "leave"),
    "reset": (_reset, "", "start a new conversation"),
    "system": (_system, "TEXT", "set the system prompt (none: clear it) and start a new conversation"),
    "think": (_think, "on|off", "turn thinking on or off"),
    "audio": (_audio, "FILE", "a sound clip sent with your next message"),
}
HELP = "commands:\n" + "\n".join(
    f"  /{name}{' ' + arg if arg else ''}".ljust(22) + what for name, (_, arg, what) in COMMANDS.items()
)
BANNER = f"gemma-ane chat: type a message; {', '.join('/' + n for n in COMMANDS)} (//text sends /text)"


def command(chat: Chat, line: str) -> bool | None:
    """Run the command `line` names; True to leave. An unknown one is answered with the list."""
    name, _, arg = line[1:].partition(" ")
    if name not in COMMANDS:
        print(f"unknown command /{name} (not sent to the model); {HELP}", file=sys.stderr)
        return None
    try:
        return COMMANDS[name][0](chat, arg.strip())
    except ValueError as e:  # no such file, not audio, too long: this command only, never the chat
        print(f"gemma-ane chat: error: {e}", file=sys.stderr)
        return None


def fit_context(model, head: list, messages: list, think: bool, max_tokens: int) -> list | None:
    """`messages` (after the system turn `head`) if their prompt leaves room for the answer (max_tokens, at most
    half the context). If not, the oldest exchanges go, with a note on stderr, until the prompt fills at most half
    of what the answer leaves, as llama.cpp's context shift discards half: the turns that follow then grow on the
    cached prompt for a while instead of dropping (and reprocessing) an exchange each. Otherwise the smallest cut
    that fits. None, and a note, if even the last message alone does not fit."""
    ctx, room, sizes = model.context, min(max_tokens, model.context // 2), {}
    for k in range(0, len(messages), 2):  # whole exchanges, so what is kept starts with a user turn
        sizes[k] = len(model.prompt_ids(messages=head + messages[k:], enable_thinking=think))
        if sizes[k] + room <= ctx and (k == 0 or sizes[k] <= (ctx - room) // 2):
            break
    else:  # no half cut: the smallest that fits
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
    load_cache(model, a.prompt_cache)
    chat = Chat(model, a.system, a.think)
    interactive = sys.stdin.isatty()
    print(BANNER, file=sys.stderr)
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
        if line.startswith("/") and not line.startswith("//"):
            if command(chat, line):
                break
            continue
        turn(chat, line.removeprefix("/"), a)
    return 0


def turn(chat: Chat, text: str, a) -> None:
    """One user message and its streamed answer; a message that cannot be sent leaves the conversation as it was."""
    model = chat.model
    head = [{"role": "system", "content": chat.system}] if chat.system else []
    content = text
    if chat.clips:
        content = [{"type": "audio", "audio": x} for x in chat.clips] + [{"type": "text", "text": text}]
    chat.clips = []
    asked = [*chat.messages, {"role": "user", "content": content}]
    try:
        fitted = fit_context(model, head, asked, chat.think, a.max_tokens)
        if fitted is None:
            return
        reply, last = answer(model, head + fitted, chat.think, a)
    except ValueError as e:  # text that is not text, a failing template: this turn only, never the chat
        print(f"gemma-ane chat: error: {e}", file=sys.stderr)
        return
    if not chat.messages:  # the first turn of a conversation: its system turn is what recurs
        save_cache(model, a.prompt_cache, last.prompt_tokens, chat.system, text, chat.think)
    chat.messages = [*fitted, {"role": "assistant", "content": reply}]


def answer(model, convo: list[dict], think: bool, a):
    """Stream one answer (thinking to stderr, so stdout holds only the answers); (text, last event)."""
    text = ""
    for ev in model.stream_generate(messages=convo, max_tokens=a.max_tokens, enable_thinking=think, **sampling(a)):
        if ev.reasoning:
            sys.stderr.write(ev.reasoning)
            sys.stderr.flush()
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        text += ev.text
    sys.stdout.write("\n")
    return text, ev


def add_command(sub) -> None:
    s = sub.add_parser("chat", help="multi-turn chat on stdin, a REPL (/help lists its commands)")
    s.add_argument("bundle", help="bundle directory")
    add_sampling(s)
    s.set_defaults(fn=cmd_chat)
