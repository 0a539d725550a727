"""The context ladder (CONTRACT §3a): one bundle carrying its chunks' functions once per context ("rung"), so a
session pays for the context it uses and climbs to a larger one only when its position needs it.

The largest rung's functions keep their plain names (infer, prefill_b8, ...): a runtime that knows no ladder runs
the bundle as a single-context bundle of that size. Every smaller rung C carries the same functions as
`ctx{C}_infer`, `ctx{C}_prefill_b8`, ..., with the context-sized states and hand-offs sized for C and the sliding
ring as the top rung's. Here: the rungs' spelling and rules, and what each rung costs per decoded token.
"""

from __future__ import annotations

import re

from .spec import ConfigError, ModelSpec

RUNG = re.compile(r"ctx(\d+)_(.+)")


def rung_function(function: str, context: int, top: int) -> str:
    """The name `function` (infer, prefill_b8, ...) carries on the rung of `context` in a ladder topped by `top`."""
    return function if context == top else f"ctx{context}_{function}"


def split_rung(name: str) -> tuple[int | None, str]:
    """(the rung's context, the plain function) of a chunk function's name; (None, name) for the top rung's."""
    m = RUNG.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def rungs_of(interfaces: dict) -> tuple[int, ...]:
    """The rungs a chunk's functions (name -> interface) carry, ascending: each smaller rung's, and the top, the
    context of its plain-named infer; () for a chunk without smaller rungs (nothing to climb, whatever it is)."""
    smaller = {c for c, _ in map(split_rung, interfaces) if c is not None}
    if not smaller:
        return ()
    top = interfaces["infer"]["inputs"]["causal_mask_full"]["shape"][-1]
    return tuple(sorted(smaller | {top}))


def parse_contexts(text: str | None) -> tuple[int, ...] | None:
    """--contexts "2048,8192,32768" as a tuple (checked against a model by `check_contexts`)."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--contexts {text!r}: expected ascending contexts 'C1,C2,...', e.g. 2048,8192,32768"
        ) from None


def check_contexts(spec: ModelSpec, contexts) -> tuple[int, ...]:
    """The rungs, refused unless each is an integer multiple of 32, at least the window, within the model's
    positions, and they ascend without repeats; the message names the offending value."""
    if isinstance(contexts, (str, bytes)) or not all(isinstance(c, int) and not isinstance(c, bool) for c in contexts):
        raise ConfigError(f"--contexts {contexts!r}: expected a list of integer contexts")
    text, W = ",".join(map(str, contexts)), spec.sliding_window
    if len(contexts) < 2:
        raise ConfigError(f"--contexts {text}: a ladder needs at least two contexts (one is --context)")
    for k, c in enumerate(contexts):
        if c % 32 or c <= 0:
            raise ConfigError(f"--contexts {text}: {c} is not a positive multiple of 32 (Core ML state dimensions)")
        if c < W:
            raise ConfigError(f"--contexts {text}: {c} is below the sliding window ({W})")
        if k and c == contexts[k - 1]:
            raise ConfigError(f"--contexts {text}: {c} is repeated")
        if k and c < contexts[k - 1]:
            raise ConfigError(f"--contexts {text}: {c} comes after {contexts[k - 1]}; contexts ascend")
    if contexts[-1] > spec.max_position_embeddings:
        raise ConfigError(
            f"--contexts {text}: {contexts[-1]} exceeds the model's max_position_embeddings="
            f"{spec.max_position_embeddings}"
        )
    return tuple(contexts)
