"""Prefix reuse in a multi-turn chat: prompt tokens processed and time to first token, with and without reuse.

    python bench/chat_reuse.py [--work DIR]    # 10 turns on an e2b-narrow bundle (window 512, context 2048),
                                               # built once into DIR (default: a temporary directory)
    python bench/chat_reuse.py --bundle PATH   # an existing bundle (a full-size one on a Mac)
    python bench/chat_reuse.py --quick         # 4 short turns on an e2b-mini bundle (window 16, context 128)

Through the Python API, greedy. The user messages are varied words drawn from a seed, sized in the
bundle's own tokens, so the conversation crosses the sliding window by turn 3-4 and ends under the
context. Two passes over the same conversation: "with reuse" keeps the caches between turns;
"without reuse" empties them before each turn and replays the first pass's answers, so both passes
see the same prompts. Per turn: the prompt's tokens, the tokens new since the previous turn's
whole conversation (prompt + answer: the goal is to process only these), and for each pass the
tokens reused, processed and the time to first token. Appends the table to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402

import gemma_ane  # noqa: E402

WORDS = """river stone window garden letter morning silver quiet engine market winter bridge candle
orange pocket ladder yellow forest button travel coffee paper mirror season harbor planet shadow music
little answer number people water first sound place thing think between picture mountain village
simple careful reason follow change animal country evening machine measure notice problem question
""".split()

# (turns, user message tokens lo-hi, answer tokens): the full run ends near 1,500-1,900 of 2048
PROFILES = {False: (10, (120, 160), 40), True: (4, (8, 12), 6)}


def bundle_for(a, tmp: str) -> tuple[Path, str]:
    """--bundle as given, or the one `build` converts (cached in --work); and what it is."""
    if a.bundle:
        return Path(a.bundle), f"bundle `{a.bundle}`"
    return build(Path(a.work or tmp), a.quick)


def build(work: Path, quick: bool) -> tuple[Path, str]:
    """The bundle this benchmark converts itself, cached in `work`; and what it is."""
    from gemma_ane.convert import ConvertOptions, convert
    from gemma_ane.oracle.tiny import write_tiny

    preset, context = ("e2b-mini", 128) if quick else ("e2b-narrow", 2048)
    root = work / f"{preset}-{context}"
    if not (root / "bundle").is_dir():  # convert and write_tiny are atomic: a directory is whole
        if not (root / "ckpt").is_dir():
            write_tiny(root / "ckpt", preset=preset)
        print(f"converting {preset} at context {context} into {root} ...", file=sys.stderr, flush=True)
        convert(
            str(root / "ckpt"),
            str(root / "bundle"),
            ConvertOptions(context=context, bits=16, vision=False),
            progress=False,
        )
    # the window and context decide which steps run and what may be reused; the widths only the time
    real = "" if quick else "E2B's real window and context, "
    return root / "bundle", (
        f"bundle `{preset}` (16-bit, random weights, hidden 64) built by this script: {real}tiny widths, "
        "so the token counts are the point and the times are this CPU's"
    )


def user_messages(model, turns: int, sizes: tuple[int, int], seed: int) -> list[str]:
    """Varied words, each message grown to a token count drawn from `sizes` (in the bundle's tokens)."""
    rng = random.Random(seed)
    out = []
    for k in range(turns):
        target, words = rng.randint(*sizes), [f"Turn {k + 1}:"]
        while len(model.encode(" ".join(words))) < target:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def turn(model, messages: list[dict], max_tokens: int) -> dict:
    """One greedy answer, streamed. `processed` counts the tokens the engine was fed before the first
    token came out: measured, so it checks the `reused_tokens` the runtime reports."""
    engine, fed, feed = model.engine, [], model.engine.feed
    engine.feed = lambda ids, **kw: fed.append(len(ids)) or feed(ids, **kw)
    try:
        stream = model.stream_generate(messages=messages, max_tokens=max_tokens, temperature=0)
        events = [next(stream)]
        processed = sum(fed)
        events += list(stream)
    finally:
        del engine.feed
    last = events[-1]
    return dict(
        prompt=last.prompt_tokens,
        reused=last.reused_tokens,
        processed=processed,
        ttft=last.time_to_first_token,
        answer=last.generated_tokens,
        tokens=[e.token for e in events if e.token is not None],
        text="".join(e.text for e in events),
    )


def chat(model, users: list[str], max_tokens: int, answers: list[str] | None = None) -> tuple[list[dict], str]:
    """One pass over the conversation. answers=None: reuse on, the model's own answers extend it;
    else: caches emptied before each turn, `answers` replayed. Returns (rows, why it stopped early)."""
    messages, rows, before = [], [], []
    for k, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        ids = model.prompt_ids(messages=messages)
        if len(ids) + max_tokens > model.context:
            return rows, f"turn {k + 1}: prompt {len(ids)} + answer {max_tokens} exceed the context of {model.context}"
        if answers is not None:
            model.reset()
        rows.append(dict(turn(model, messages, max_tokens), new=len(ids) - common_prefix(ids, before)))
        print(f"  turn {k + 1}: {rows[-1]['prompt']} prompt, {rows[-1]['reused']} reused", file=sys.stderr, flush=True)
        before = ids + rows[-1]["tokens"]
        messages.append({"role": "assistant", "content": rows[-1]["text"] if answers is None else answers[k]})
    return rows, ""


def total(rows: list[dict], key: str):
    return sum(r[key] for r in rows)


def report(about: str, model, reuse: list[dict], fresh: list[dict], stopped: str) -> str:
    lines = [
        f"{about}; window {model.engine.window}, context {model.context}, backend {model.backend}.",
        "Greedy; each turn adds a user message and the previous answer. prompt: the turn's prompt tokens; "
        "new: those not in the previous turn's prompt + answer (the goal: process only these); "
        "answer: tokens generated; processed: prompt tokens the engine was fed, counted at the engine.",
        "",
        "| turn | prompt | new | answer | with reuse: reused | processed | TTFT | without: reused | processed | TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, (a, b) in enumerate(zip(reuse, fresh), 1):
        lines.append(
            f"| {k} | {a['prompt']} | {a['new']} | {a['answer']} | {a['reused']} | {a['processed']} "
            f"| {a['ttft']:.2f} s | {b['reused']} | {b['processed']} | {b['ttft']:.2f} s |"
        )
    lines.append(
        f"| total | {total(reuse, 'prompt')} | {total(reuse, 'new')} | {total(reuse, 'answer')} "
        f"| {total(reuse, 'reused')} | {total(reuse, 'processed')} | {total(reuse, 'ttft'):.2f} s "
        f"| {total(fresh, 'reused')} | {total(fresh, 'processed')} | {total(fresh, 'ttft'):.2f} s |"
    )
    processed, ttft = (
        (total(reuse, "processed"), total(fresh, "processed")),
        (total(reuse, "ttft"), total(fresh, "ttft")),
    )
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(reuse, fresh))
    blank = sum(not r["text"].strip() for r in reuse)
    lines += [
        "",
        f"- prompt tokens processed, without / with reuse: {processed[1]} / {processed[0]} "
        f"= {processed[1] / max(processed[0], 1):.2f}x",
        f"- time to first token, without / with reuse: {ttft[1]:.2f} s / {ttft[0]:.2f} s "
        f"= {ttft[1] / max(ttft[0], 1e-9):.2f}x",
        f"- goal, each turn processes only its new tokens: {total(reuse, 'new')} new, {processed[0]} processed",
        f"- answers equal in both passes: {same}/{len(reuse)} turns",
    ]
    if blank:  # a random model's greedy answer is often whitespace, which the template trims away
        lines.append(f"- answers that were only whitespace (empty in the next prompt): {blank}/{len(reuse)}")
    if stopped:
        lines.append(f"- stopped early: {stopped}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", help="an existing bundle (default: convert a narrow one with the real window/context)")
    p.add_argument("--work", help="where the built bundle is cached (default: a temporary directory)")
    p.add_argument("--backend", default="auto", choices=["auto", "coreml", "mil"])
    p.add_argument("--turns", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 short turns on a tiny e2b-mini bundle; never recorded")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    turns, sizes, max_tokens = PROFILES[a.quick]
    turns = turns if a.turns is None else a.turns
    if turns < 1:
        p.error("--turns must be >= 1")

    with tempfile.TemporaryDirectory() as tmp:
        bundle, about = bundle_for(a, tmp)
        model = gemma_ane.load(bundle, backend=a.backend)
        users = user_messages(model, turns, sizes, a.seed)
        # functions load on first use (seconds each on Core ML): two throwaway turns run the paths a
        # fresh prompt and a reused one take, so neither pass pays for loading them
        print("warm-up:", file=sys.stderr)
        chat(model, users[:2], 1)
        model.reset()
        print("with reuse:", file=sys.stderr)
        reuse, stopped = chat(model, users, max_tokens)
        print("without reuse:", file=sys.stderr)
        fresh, _ = chat(model, users[: len(reuse)], max_tokens, answers=[r["text"] for r in reuse])
    publish(f"Prefix reuse in a {len(reuse)}-turn chat", report(about, model, reuse, fresh, stopped), a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
